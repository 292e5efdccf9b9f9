"""Small helpers for the sentences the notebooks and the command-line tools render. No torch: the tools that run
before torch is installed (``hosted``, ``student``, ``grade``) use them too."""

from __future__ import annotations


def plural(n: float, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural where ``n`` is not 1: "1 call", "3 calls", "2 GPUs"; ``many`` where adding
    an "s" is wrong ("1 batch", "2 batches"). For rendered sentences: no "call(s)"."""
    shown = f"{n:,}" if float(n).is_integer() else f"{n:g}"  # 1,234,567 calls, not 1.23457e+06
    return f"{shown.removesuffix('.0')} {word if n == 1 else (many or word + 's')}"
