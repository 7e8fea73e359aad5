"""What the launcher shows of its workers' output: every line that says something, once.

Every worker's complete output goes to its log file; the console hides TensorFlow's
known start-up notices (`NOISE`) and every worker's Keras progress lines but the
first's (`PROGRESS`), shows a line that several workers print within `WINDOW` seconds
once ("[workers 0-1] line"), turns a traceback that ends in a peer's loss
(`CONSEQUENCES`) into one line naming it, and passes every other line as
"[worker i] line". `verbose=True` (`--verbose`, TF_DISTRIB_VERBOSE=1) shows every line.
"""

from __future__ import annotations

import re
import threading
import time

#: Lines TensorFlow prints at every start of every worker; hidden from the console.
NOISE = re.compile("|".join([
    r"All log messages before absl::InitializeLog\(\) is called",
    r"cudart_stub\.cc.*Could not find cuda drivers",
    r"cuda_platform\.cc.*failed call to cuInit",
    r"cuda_executor\.cc|cuda_dnn\.cc|cuda_fft\.cc|cuda_blas\.cc",
    r"oneDNN custom operations are on",
    r"This TensorFlow binary is optimized to use available CPU instructions",
    r"To enable the following instructions: .* rebuild TensorFlow",
    r"Unable to register cu(DNN|FFT|BLAS) factory",
]))
#: Keras' progress lines: "Epoch 2/3" and "32/32 ━━━━ 1s 5ms/step - loss: 0.4".
PROGRESS = re.compile(r"^(Epoch \d+/\d+\s*$|\s*\d+/\d+ .*(━|/step))")
#: Exceptions that a worker raises because a peer was lost, stopped or aborted.
CONSEQUENCES = re.compile("|".join([
    r"PeerLostError", r"UnavailableError", r"AbortedError", r"DeadlineExceededError",
    r"CancelledError: .*[Cc]ollective", r"did not join the transport's rendezvous",
    r"reported a hang",
]))
#: "1" shows every line of every worker (`tf-distrib launch --verbose`).
ENV_VERBOSE = "TF_DISTRIB_VERBOSE"
#: Seconds a line waits for the same line from the other workers.
WINDOW = 0.25
# A traceback goes on (chained exceptions, TensorFlow's op stacks) until its worker
# pauses this many seconds or exits.
_TRACEBACK_PAUSE = 0.5
_TRACEBACK = "Traceback (most recent call last):"


class Console:
    """Condensed console output of one attempt's workers.

    Args:
        workers: The workers' global indices, in the order `write` numbers them.
        stdout: Where stdout lines go; None shows nothing.
        stderr: Where stderr lines go; None shows nothing.
        verbose: Show every line as it comes. Defaults to False.
    """

    def __init__(self, workers: list[int], stdout, stderr, *, verbose: bool = False):
        self._names, self._verbose = workers, verbose
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()
        self._pending: list[list] = []  # [stream, text, workers, since]
        self._tracebacks: dict[int, list] = {}  # worker -> [stream, lines, last line at]
        self._closed = threading.Event()
        if not verbose:
            threading.Thread(target=self._flush_loop, name="tf_distrib-console",
                             daemon=True).start()

    def write(self, worker: int, stream: str, line: str) -> None:
        """Takes one line (ending in a newline) that worker number `worker` printed."""
        with self._lock:
            if self._verbose:
                self._emit(stream, [worker], line)
                return
            text = line.rstrip("\n")
            block = self._tracebacks.get(worker)
            if block is not None:
                block[1].append(line)
                block[2] = time.monotonic()
            elif text.startswith(_TRACEBACK):
                self._tracebacks[worker] = [stream, [line], time.monotonic()]
            elif not NOISE.search(text) and not (worker and PROGRESS.match(text)):
                self._add(stream, worker, line)

    def close(self) -> None:
        """Shows what is still held (call once the workers' output has ended)."""
        self._closed.set()
        with self._lock:
            for worker in list(self._tracebacks):
                self._end_traceback(worker)
            self._flush(everything=True)

    def _end_traceback(self, worker: int) -> None:
        stream, lines, _ = self._tracebacks.pop(worker)
        # Exception lines stand at the left margin (TensorFlow's span several lines).
        errors = [line.strip() for line in lines if line[:1].strip()]
        consequence = next((e for e in reversed(errors) if CONSEQUENCES.search(e)), None)
        if consequence is not None:
            self._add(stream, worker, f"failed because a peer failed first ({len(lines)}-line "
                                      f"traceback in its log): {consequence}\n")
        else:
            for line in lines:
                self._add(stream, worker, line, alone=True)

    def _add(self, stream: str, worker: int, line: str, alone: bool = False) -> None:
        """Holds `line` for the same line from the other workers (unless `alone`)."""
        if not alone:
            for entry in self._pending:
                if entry[0] == stream and entry[1] == line and worker not in entry[2]:
                    entry[2].append(worker)
                    return
        self._pending.append([stream, line, [worker], -1.0 if alone else time.monotonic()])
        self._flush()

    def _flush_loop(self) -> None:
        while not self._closed.wait(WINDOW / 4):
            with self._lock:
                now = time.monotonic()
                for worker, block in list(self._tracebacks.items()):
                    if now - block[2] > _TRACEBACK_PAUSE:
                        self._end_traceback(worker)
                self._flush()

    def _flush(self, everything: bool = False) -> None:
        """Shows held lines, oldest first, once every worker sent them or they aged."""
        now = time.monotonic()
        while self._pending:
            stream, line, workers, since = self._pending[0]
            if not (everything or len(workers) == len(self._names) or now - since > WINDOW):
                break
            self._pending.pop(0)
            self._emit(stream, workers, line)

    def _emit(self, stream: str, workers: list[int], line: str) -> None:
        target = self._streams[stream]
        if target is None:
            return
        target.write(_prefix([self._names[w] for w in workers]) + line)
        target.flush()


def _prefix(names: list[int]) -> str:
    if len(names) == 1:
        return f"[worker {names[0]}] "
    names = sorted(names)
    if names == list(range(names[0], names[-1] + 1)):
        return f"[workers {names[0]}-{names[-1]}] "
    return f"[workers {','.join(map(str, names))}] "
