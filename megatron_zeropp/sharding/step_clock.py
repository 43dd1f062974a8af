"""The step clock of one ZeRO++ layer (one model chunk): which training iteration runs, and what
that switches on.

Everything of the layer that depends on where training is lives here, in one object the layer
advances itself, so that every loop that drives the layer gets the same behaviour from the calls
megatron-core's schedules already make:

* **when**: :meth:`StepClock.begin_iteration`, from the layer's ``zero_grad_buffer`` (Megatron-LM's
  ``train_step`` and this project's both call it on every chunk before an iteration's first
  forward). Megatron-LM's rerun state machine (``--rerun-mode validate_results``) runs an
  iteration's forward/backward a second time, ``zero_grad_buffer`` included, to check that it
  reproduces: that second call restarts the *same* iteration (counters back to its start), so the
  rerun rounds exactly as the run it checks;
* **the per-step switches**: qgZ on or off (``qgz_fraction`` of ``train_iters``, the cutoff given
  once, at construction) and whether this iteration measures the qgZ error
  (``qgz_error_interval``) or the qwZ weight error (``qwz_error_interval``);
* **the stochastic-rounding keys** and their counters: qgZ's (iteration, the bucket's reduction
  count within it), qwZ's (the count of weight updates, which a resumed run restores, instead
  of the layer's weight version, which a load bumps), qwZ differences' (the unit's count of
  differences sent). With several chunks per rank (virtual pipeline stages) each chunk's
  ``chunk_index`` joins its keys, so two chunks never share one; chunk 0's keys are those of a
  single-chunk layer.

Its state (:meth:`StepClock.state_dict`) is part of the layer's per-rank state
(:meth:`~megatron_zeropp.sharding.data_parallel.ZeroPPDataParallel.rank_state`); nothing outside
writes its fields.
"""

from __future__ import annotations

from typing import Dict, Optional

from megatron_zeropp.quant.rounding import derive_key

from .config import ZeroPPConfig

# Streams of the rounding keys: one per kind of quantization, so that no two share random bits.
QWZ, QGZ, QWZ_DIFF = 0, 1, 2


class StepClock:
    """The iteration a layer is in, the switches it sets and the rounding keys it derives.

    Args:
        config: the layer's ZeRO++ configuration.
        dp_rank: this rank's index in its data-parallel group (a key component).
        train_iters: the run's number of training iterations; needed only with
            ``qgz_fraction < 1`` (the cutoff), else may be ``None``.
        chunk_index: this chunk's index among the rank's model chunks (virtual pipeline
            stage); a key component, 0 for a single chunk.
    """

    def __init__(self, config: ZeroPPConfig, dp_rank: int, train_iters: Optional[int] = None,
                 chunk_index: int = 0):
        if train_iters is not None and (not isinstance(train_iters, int)
                                        or isinstance(train_iters, bool) or train_iters < 1):
            raise ValueError(f"train_iters must be None or an int >= 1, got {train_iters!r}")
        if config.qgz and config.qgz_fraction < 1.0 and train_iters is None:
            raise ValueError(f"qgz_fraction={config.qgz_fraction} needs the run's train_iters "
                             "(the iteration where qgZ switches off), got None")
        if not isinstance(chunk_index, int) or isinstance(chunk_index, bool) or chunk_index < 0:
            raise ValueError(f"chunk_index must be an int >= 0, got {chunk_index!r}")
        self.config = config
        self.dp_rank = dp_rank
        self.train_iters = train_iters
        self.chunk_index = chunk_index
        # qgZ is on for iterations [0, cutoff); None: always.
        self.qgz_cutoff: Optional[float] = (
            config.qgz_fraction * train_iters if config.qgz_fraction < 1.0 else None)
        self._begun = 0  # iterations begun (a rerun of one counts once)
        self._weight_updates = 0
        self._buckets = 0
        self._reductions: Dict[int, int] = {}  # bucket id -> qgZ reductions in this iteration

    # -- where training is -------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """The 0-based iteration running (0 also before the first :meth:`begin_iteration`)."""
        return max(self._begun - 1, 0)

    @property
    def iterations_begun(self) -> int:
        """How many iterations :meth:`begin_iteration` started."""
        return self._begun

    def begin_iteration(self, rerun: bool = False) -> bool:
        """An iteration starts (``zero_grad_buffer``). ``rerun``: the same iteration runs again
        (megatron-core's rerun state machine re-running it in place): its counters go back to
        its start and the iteration stays. Returns whether a new iteration began."""
        self._reductions = {}
        if rerun and self._begun:
            return False
        self._begun += 1
        return True

    def weights_changed(self) -> None:
        """The layer's weights were replaced (an optimizer step, a load, a broadcast)."""
        self._weight_updates += 1

    # -- per-step switches ---------------------------------------------------------------------
    @property
    def qgz_active(self) -> bool:
        """Whether this iteration's gradients go through qgZ (``qgz_fraction``); when it turns
        off, error-feedback residuals are flushed into the next exact reduction."""
        if not self.config.qgz:
            return False
        return self.qgz_cutoff is None or self.iteration < self.qgz_cutoff

    def _every(self, interval: int) -> bool:
        """Whether ``interval`` (0: never) picks this iteration: the first and every
        interval-th, numbered from 1 as the log numbers them."""
        n = self.iteration + 1
        return bool(interval) and (n == 1 or n % interval == 0)

    @property
    def measure_qgz_error(self) -> bool:
        """Whether this iteration measures the qgZ error (``qgz_error_interval``; only while
        qgZ is active)."""
        return self.qgz_active and self._every(self.config.qgz_error_interval)

    @property
    def measure_qwz_error(self) -> bool:
        """Whether this iteration measures the qwZ weight error (``qwz_error_interval``)."""
        return self._every(self.config.qwz_error_interval)

    # -- stochastic-rounding keys --------------------------------------------------------------
    def register_bucket(self) -> int:
        """A new bucket's id (buckets numbered in construction order, the same on every rank of
        the DP group)."""
        self._buckets += 1
        return self._buckets - 1

    def _key(self, stream: int, counters: tuple, bucket_id: int) -> int:
        # Chunk 0 adds nothing: a single-chunk layer keeps the keys it always had.
        chunk = (self.chunk_index,) if self.chunk_index else ()
        return derive_key(self.config.rounding_seed, stream, *counters, self.dp_rank, bucket_id,
                          *chunk)

    def qwz_key(self, bucket_id: Optional[int]) -> Optional[int]:
        """qwZ's key of a bucket's gather now (``None``: rounding to nearest). The same for every
        gather between two weight updates (forward, backward, micro-batches)."""
        if not self.config.qwz_stochastic_rounding or bucket_id is None:
            return None
        return self._key(QWZ, (self._weight_updates,), bucket_id)

    def diff_key(self, bucket_id: int, sent: int) -> Optional[int]:
        """The key of a bucket's qwZ differences: by the unit's count of differences ``sent``
        (saved with checkpoints), so a resumed run rounds the same way."""
        if not self.config.qwz_stochastic_rounding:
            return None
        return self._key(QWZ_DIFF, (sent,), bucket_id)

    def qgz_key(self, bucket_id: Optional[int]) -> Optional[int]:
        """qgZ's key of a bucket's next reduction: (iteration, the bucket's reductions so far in
        it: several with ``shard_grads``, one per micro-batch)."""
        if not self.config.qgz_rounds_stochastically or bucket_id is None:
            return None
        count = self._reductions.get(bucket_id, 0)
        self._reductions[bucket_id] = count + 1
        return self._key(QGZ, (self.iteration, count), bucket_id)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed run needs to go on as the uninterrupted one (per rank; the same on
        every rank of a chunk)."""
        return {"iterations_begun": self._begun, "weight_updates": self._weight_updates}

    def load_state_dict(self, state: Optional[dict], iterations_done: int) -> None:
        """Resume after ``iterations_done`` iterations (the checkpoint's iteration) from a saved
        ``state`` (``None``: none saved; the weight-update count then starts anew). The saved
        clock began ``iterations_done`` iterations, or one more when the checkpoint was taken
        inside an iteration (megatron-core's rerun state machine saving to re-run it elsewhere);
        any other count belongs to another checkpoint and is refused."""
        if not isinstance(iterations_done, int) or iterations_done < 0:
            raise ValueError(f"iterations_done must be an int >= 0, got {iterations_done!r}")
        if state is not None:
            begun = state["iterations_begun"]
            if begun not in (iterations_done, iterations_done + 1):
                raise ValueError(
                    f"step clock saved after {begun} iterations begun, in a checkpoint of "
                    f"iteration {iterations_done}: the per-rank state is another checkpoint's")
            self._weight_updates = state["weight_updates"]
        else:
            self._weight_updates = 0
        self._begun = iterations_done
        self._reductions = {}
