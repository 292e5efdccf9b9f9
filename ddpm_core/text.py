"""Small helpers for the sentences the notebooks and the command-line tools render. No torch: the tools that run
before torch is installed (``hosted``, ``student``, ``grade``) use them too."""

from __future__ import annotations


def plural(n: float, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural where ``n`` is not 1: "1 call", "3 calls", "2 GPUs"; ``many`` where adding
    an "s" is wrong ("1 batch", "2 batches"). For rendered sentences: no "call(s)"."""
    return f"{n:g} {word if n == 1 else (many or word + 's')}"
