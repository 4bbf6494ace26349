"""A small offline multiple-choice task built from a local corpus: choose a paragraph's true next sentence.

Each example is the opening sentences of a Wikipedia paragraph (the context) and four endings: the sentence
that follows in the article and three sentences drawn from other articles, of similar length in tokens (each
at most ``MAX_ENDING_TOKENS``), in a seeded random order. A language model scores each ending's log-likelihood
after the context (lm-evaluation-harness' ``multiple_choice``); chance is 25%. :func:`write_task` writes the
examples (``next_sentence.jsonl``) and an lm-evaluation-harness task YAML whose ``data_files`` point at them,
so ``--include_path <folder>`` makes the task available with no network.
"""

from __future__ import annotations

import html
import json
import random
import re
from pathlib import Path

from corpus.atomic import atomic_write_text
from corpus.sources import LocalFilesSource
from corpus.tokenize import tiktoken_encoding

TASK_NAME = "wiki_next_sentence"
DATA_FILE = "next_sentence.jsonl"
CHOICES = 4
# A sentence ends at . ! or ? followed by space and a capital letter (abbreviations split rarely, harmlessly).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
MIN_WORDS, MAX_WORDS = 5, 40
# lm-evaluation-harness cuts a context that does not fit the model's window from the left but needs the whole
# ending: endings of at most this many GPT-2 tokens fit the
# CPU study's 32-token window with 8 tokens of context.
MAX_ENDING_TOKENS = 24


def sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph, HTML entities (``&amp;`` in WikiExtractor's output) decoded."""
    return [s.strip() for s in _SENTENCE_END.split(html.unescape(paragraph).strip()) if s.strip()]


def _usable(sentence: str) -> bool:
    return MIN_WORDS <= len(sentence.split()) <= MAX_WORDS


def build_examples(corpus: str | Path, count: int, seed: int = 0, context_sentences: int = 2,
                   max_ending_tokens: int = MAX_ENDING_TOKENS) -> list[dict]:
    """``count`` examples from the articles of ``corpus`` (a WikiExtractor folder, or any
    LocalFilesSource)."""
    encoding = tiktoken_encoding("gpt2")
    rng = random.Random(seed)

    def tokens(sentence: str) -> int:  # as the ending is scored: after the target delimiter " "
        return len(encoding.encode_ordinary(" " + sentence))
    candidates: list[tuple[int, str, str]] = []  # (article, context, true next sentence)
    pool: list[tuple[int, str, int]] = []  # (article, sentence, its tokens): where distractors come from
    for article, text in enumerate(LocalFilesSource(path=str(corpus)).sampled_documents(seed)):
        for paragraph in text.split("\n"):
            parts = sentences(paragraph)
            endings = [(s, tokens(s)) for s in parts if _usable(s)]
            pool += [(article, s, n) for s, n in endings if n <= max_ending_tokens]
            if len(parts) < context_sentences + 1 or not all(
                _usable(s) for s in parts[: context_sentences + 1]
            ):
                continue
            if tokens(parts[context_sentences]) <= max_ending_tokens:
                candidates.append((article, " ".join(parts[:context_sentences]), parts[context_sentences]))
        if len(candidates) >= 2 * count and len(pool) >= 20 * count:
            break
    if len(candidates) < count:
        raise ValueError(
            f"{corpus} yields only {len(candidates)} paragraphs of {context_sentences + 1}+ sentences, "
            f"{count} examples were asked for"
        )
    examples = []
    for article, context, answer in rng.sample(candidates, count):
        length = tokens(answer)
        similar = [s for a, s, n in pool if a != article and 0.5 * length <= n <= 2 * length]
        distractors = rng.sample(similar, CHOICES - 1)
        choices = [answer, *distractors]
        rng.shuffle(choices)
        examples.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return examples


def task_yaml(data_file: Path) -> str:
    """The lm-evaluation-harness task config: local JSON lines, log-likelihood of each ending."""
    return f"""# Built by `python -m normgeo.evaluate --make-task`: {CHOICES}-way choice of a \
Wikipedia paragraph's next sentence.
task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data_file.resolve()))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(out_dir: Path, corpus: str | Path, count: int = 500, seed: int = 0) -> Path:
    """The examples and the task YAML into ``out_dir`` (each written atomically); returns the YAML's path."""
    examples = build_examples(corpus, count, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_file = out_dir / DATA_FILE
    atomic_write_text(data_file, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples))
    config = out_dir / f"{TASK_NAME}.yaml"
    atomic_write_text(config, task_yaml(data_file))
    return config
