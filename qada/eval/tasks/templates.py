"""RULER's template strings, copied verbatim from ``nvidia-long-context-eval`` (its ``data/synthetic/constants.py``,
``data/template.py`` and the generator scripts ``niah.py``, ``variable_tracking.py``, ``qa.py``).

``tests/test_tasks_templates.py`` checks every string here against the files the package ships.
"""

from __future__ import annotations

__all__ = [
    "CWE_NUM_WORDS_QUESTION",
    "MODEL_TEMPLATES",
    "NIAH_NEEDLE",
    "QA_DOCUMENT_PROMPT",
    "REPEAT_HAYSTACK",
    "TASK_TEMPLATES",
    "VT_NOISE",
]

#: RULER's model template for completion-style prompts (``Templates['base']`` in ``data/template.py``).
MODEL_TEMPLATES = {"base": "{task_template}"}

#: ``TASKS`` of ``data/synthetic/constants.py``: generation budget, task template and answer prefix.
TASK_TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",  # noqa: E501
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",  # noqa: E501
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined the value {query}, they are: ",  # noqa: E501
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",  # noqa: E501
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",  # noqa: E501
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",  # noqa: E501
        "answer_prefix": " Answer:",
    },
}

#: the needle of ``niah.py`` (``needle = ...``).
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

#: the ``repeat`` haystack of ``niah.py`` (``haystack = ...``), also the noise of ``variable_tracking.py``.
REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: the noise sentence of ``variable_tracking.py`` (``noise = ...``).
VT_NOISE = REPEAT_HAYSTACK + "\n"

#: ``DOCUMENT_PROMPT`` of ``qa.py``.
QA_DOCUMENT_PROMPT = "Document {i}:\n{document}"

#: the number of common words the cwe question asks for (fixed in its template).
CWE_NUM_WORDS_QUESTION = 10
