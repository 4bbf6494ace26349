"""The GPT-2 tokenizer the harness trained with, as a ``transformers`` tokenizer.

Built from tiktoken's loaded ``gpt2`` encoding (the BPE files in ``TIKTOKEN_CACHE_DIR``) through
transformers' own ``TikTokenConverter`` (byte-level vocabulary and merges recovered from the ranks, the
encoding's split pattern, ``<|endoftext|>`` as its special token), wrapped as ``GPT2TokenizerFast``. No
network and no Hub download: the ids are tiktoken's (checked in tests/test_export.py on the probe text).
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from corpus.tokenize import tiktoken_encoding

EOT = "<|endoftext|>"


def gpt2_tokenizer(model_max_length: int = 1024):
    """A ``GPT2TokenizerFast`` that encodes every text to tiktoken ``gpt2``'s ids."""
    from transformers import GPT2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = tiktoken_encoding("gpt2")
    with tempfile.TemporaryDirectory() as scratch:
        ranks = Path(scratch) / "gpt2.tiktoken"
        # tiktoken's own file format (what tiktoken.load.dump_tiktoken_bpe writes, without its blobfile need)
        ranks.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                 for token, rank in sorted(encoding._mergeable_ranks.items(), key=lambda x: x[1])))
        backend = TikTokenConverter(
            vocab_file=str(ranks), pattern=encoding._pat_str, extra_special_tokens=encoding._special_tokens
        ).converted()
    return GPT2TokenizerFast(
        tokenizer_object=backend, bos_token=EOT, eos_token=EOT, unk_token=EOT, model_max_length=model_max_length,
        add_prefix_space=False,
    )
