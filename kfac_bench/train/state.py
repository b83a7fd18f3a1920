"""Where a run is: epoch, step, examples seen and its clocks; a checkpoint part (see
:mod:`kfac_bench.train.checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kfac_bench.metrics.tracker import Clock, Throughput

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Progress that a checkpoint restores.

    Attributes:
        epoch: epochs completed.
        step: optimizer steps completed.
        micro_in_epoch: micro-batches this rank consumed in the current epoch (the sampler skips them on
            resume; restarted at 0 when the checkpoint came from another number of ranks).
        samples: training examples seen over all ranks.
        wall / train_clock: wall time (steps, evaluations, checkpoints) and training time (steps only),
            accumulated over restarts.
        throughput: step times and samples.
        last_eval_step: the step of the last evaluation (-1: none yet).
        world_size: ranks of this run (for ``micro_in_epoch`` on resume).
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
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        s = state_dict
        self.epoch, self.step, self.samples = s["epoch"], s["step"], s["samples"]
        self.micro_in_epoch = s["micro_in_epoch"] if s["world_size"] == self.world_size else 0
        self.wall, self.train_clock = Clock(s["wall_time_s"]), Clock(s["train_time_s"])
        self.last_eval_step = s["last_eval_step"]
        self.throughput.load_state_dict(s["throughput"])
