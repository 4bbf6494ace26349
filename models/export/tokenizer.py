"""The GPT-2 tokenizer the harness trained with, as a ``transformers`` tokenizer.

Built from tiktoken's loaded ``gpt2`` encoding (the BPE files in ``TIKTOKEN_CACHE_DIR``) by transformers'
own ``TikTokenConverter``, wrapped as ``GPT2TokenizerFast``: no network, no Hub download, tiktoken's ids.
"""

from __future__ import annotations

from transformers import GPT2TokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from corpus.tokenize import tiktoken_encoding

EOT = "<|endoftext|>"


class RanksConverter(TikTokenConverter):
    """transformers' converter fed tiktoken's ranks in memory. Its own loader reads them from a file through
    tiktoken, which copies every file it reads into ``$TIKTOKEN_CACHE_DIR/<sha1 of the path>``: a temporary
    file per export left one 835 KB file in the user's cache each time."""

    def __init__(self, ranks: dict[bytes, int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.ranks = ranks

    def load_tiktoken_bpe(self, tiktoken_url: str | None) -> dict[bytes, int]:
        return self.ranks  # no file: nothing for tiktoken to copy into its cache


def gpt2_tokenizer(model_max_length: int = 1024) -> GPT2TokenizerFast:
    """A ``GPT2TokenizerFast`` that encodes every text to tiktoken ``gpt2``'s ids; writes no file anywhere."""
    encoding = tiktoken_encoding("gpt2")
    backend = RanksConverter(
        encoding._mergeable_ranks, pattern=encoding._pat_str, extra_special_tokens=encoding._special_tokens
    ).converted()
    return GPT2TokenizerFast(
        tokenizer_object=backend,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        model_max_length=model_max_length,
        add_prefix_space=False,
    )
