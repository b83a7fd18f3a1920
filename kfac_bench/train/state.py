"""Where a run is: epoch, step, examples seen and its clocks; a checkpoint part (see
:mod:`kfac_bench.checkpoint.manager`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kfac_bench.errors import ConfigError
from kfac_bench.metrics.timekeeping import Clock, Throughput

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Progress that a checkpoint restores.

    Attributes:
        epoch: epochs completed.
        step: optimizer steps completed.
        micro_in_epoch: micro-batches each rank consumed in the current epoch; saved as the global position
            ``sample_in_epoch`` (examples over all ranks), which a resume on any number of ranks continues
            from (:class:`kfac_bench.data.loader.ResumableSampler`).
        samples: training examples seen over all ranks.
        wall / train_clock: wall time (steps, evaluations, checkpoints) and training time (steps only),
            accumulated over restarts.
        throughput: step times and samples.
        last_eval_step: the step of the last evaluation (-1: none yet).
        world_size: ranks of this process's job (for ``micro_in_epoch`` on resume).
        batch_size: examples per micro-batch on one rank (``train.batch_size``).
        global_batch: examples per optimizer step over all ranks: a property of the run, which a resume on
            another number of ranks keeps (:mod:`kfac_bench.checkpoint.elastic`); 0: not known.
        reference_world_size: the ranks the run started with, whose hyperparameters it keeps.
        saved_world_size: after :meth:`load_state_dict`, the ranks that wrote the checkpoint.
    """

    epoch: int = 0
    step: int = 0
    micro_in_epoch: int = 0
    samples: int = 0
    wall: Clock = field(default_factory=Clock)
    train_clock: Clock = field(default_factory=Clock)
    throughput: Throughput = field(default_factory=Throughput)
    last_eval_step: int = -1
    world_size: int = 1
    batch_size: int = 1
    global_batch: int = 0
    reference_world_size: int = 1
    saved_world_size: int | None = None

    @property
    def sample_in_epoch(self) -> int:
        """Examples (over all ranks) consumed in the current epoch: the position in the epoch's order."""
        return self.micro_in_epoch * self.batch_size * self.world_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "micro_in_epoch": self.micro_in_epoch,
            "samples": self.samples,
            "wall_time_s": self.wall.elapsed,
            "train_time_s": self.train_clock.elapsed,
            "last_eval_step": self.last_eval_step,
            "throughput": self.throughput.state_dict(),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "sample_in_epoch": self.sample_in_epoch,
            "global_batch": self.global_batch,
            "reference_world_size": self.reference_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        s = state_dict
        self.epoch, self.step, self.samples = s["epoch"], s["step"], s["samples"]
        self.micro_in_epoch = self._micro_in_epoch(s)
        self.saved_world_size = int(s["world_size"])
        self.wall, self.train_clock = Clock(s["wall_time_s"]), Clock(s["train_time_s"])
        self.last_eval_step = s["last_eval_step"]
        self.throughput.load_state_dict(s["throughput"])

    def _micro_in_epoch(self, s: dict[str, Any]) -> int:
        """This job's micro-batches per rank at the saved position in the epoch.

        Raises:
            ConfigError: the checkpoint's run has another global batch or reference world, or its position
                is not a whole number of this job's micro-batches (one line).
        """
        if "global_batch" not in s:  # written before positions were global: same world size only
            if s["world_size"] != self.world_size:
                raise ConfigError(
                    f"the checkpoint was written by {s['world_size']} ranks by a kfac-bench version "
                    f"that cannot resume on another number of ranks: resume on {s['world_size']} ranks"
                )
            return int(s["micro_in_epoch"])
        saved = (s["global_batch"], s["reference_world_size"])
        if self.global_batch and saved != (self.global_batch, self.reference_world_size):
            raise ConfigError(
                f"the checkpoint's run has global batch {s['global_batch']} as started on "
                f"{s['reference_world_size']} ranks, this job global batch {self.global_batch} as "
                f"started on {self.reference_world_size}: the run's world record (world.json) was "
                "lost or changed; restore it or start a new run"
            )
        per_micro = self.batch_size * self.world_size
        position = int(s["sample_in_epoch"])
        if position % per_micro:
            raise ConfigError(
                f"the checkpoint stopped at example {position} of its epoch, which is not a whole number "
                f"of micro-batches of {self.batch_size} x {self.world_size} ranks: resume on "
                f"{s['world_size']} ranks"
            )
        return position // per_micro
