"""Progress display for long offline generations (no flags here, so any binary or test may import it)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A progress callback for LLM.generate: (finished, total, tokens) -> a bar on stderr."""

    def __init__(self, label: str = ""):
        self.label, self.t0 = label, time.perf_counter()
        self.last_write: float | None = None
        try:
            import tqdm
        except ImportError:
            tqdm = None
        self._tqdm, self._bar = tqdm, None

    def __call__(self, finished: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if finished < total and self.last_write is not None and now - self.last_write < 0.2:  # GPU steps: ms
            return
        self.last_write = now
        stats = f"{tokens} tokens, {tokens / max(now - self.t0, 1e-9):.1f} tok/s"
        if self._tqdm is not None:
            if self._bar is None:
                self._bar = self._tqdm.tqdm(total=total, desc=self.label or "generate", unit="prompt", file=sys.stderr)
            self._bar.set_postfix_str(stats, refresh=False)
            self._bar.n = finished
            self._bar.refresh()
        else:
            prefix = f"{self.label}: " if self.label else ""
            sys.stderr.write(f"\r{prefix}generated {finished}/{total} prompts, {stats}\x1b[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.last_write is not None:
            sys.stderr.write("\n")
