"""A profile file is data from elsewhere: every number bounded and finite, words where words go, aliases
that cannot blow up, ``2e-2`` read as a number; each refusal one line naming the file and the key."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from kfac_bench.errors import ConfigError
from kfac_bench.plan.config import MAX_WORLD_SIZE
from kfac_bench.plan.safe_yaml import MAX_NODES, load_yaml
from kfac_bench.plan.stage_profile import load_profile

GOOD = """\
device: test bench
model: small_cnn
precision: fp32
measured_at: {world_size: 4, batch_size: 64, grad_workers: 4, placement: lpt}
baseline_step_s: {value: 0.01, source: measured}
stages_s: {factor: 1e-3, decomposition: 2e-2, precondition: 0.0005, kl_clip: 0.0001}
network: {bandwidth_gb_s: 12.5, latency_us: 6.6}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def refusal(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    return message


def test_an_exponent_without_a_dot_is_a_number(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML's default) reads 2e-2 as the string '2e-2'; a profile reads it as 0.02."""
    profile = load_profile(write(tmp_path, GOOD))
    assert profile.stages_s["decomposition"] == 0.02 and profile.stages_s["factor"] == 0.001
    # A quoted one stays text, and text is not a number.
    message = refusal(tmp_path, GOOD.replace("decomposition: 2e-2", "decomposition: '2e-2'"))
    assert "stages_s.decomposition='2e-2' must be a number" in message


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (("kl_clip: 0.0001", "kl_clip: .inf"), "stages_s.kl_clip=inf must be a finite number"),
        (("kl_clip: 0.0001", "kl_clip: .nan"), "stages_s.kl_clip=nan must be a finite number"),
        (("value: 0.01", "value: -.inf"), "baseline_step_s=-inf must be a finite number"),
        (
            ("value: 0.01", "value: 1e300"),
            "baseline_step_s=1e+300 must be a finite number >= 0 and <= ",
        ),
        (("latency_us: 6.6", "latency_us: .inf"), "network.latency_us=inf"),
        (
            ("bandwidth_gb_s: 12.5", "bandwidth_gb_s: 1e12"),
            "network.bandwidth_gb_s=1000000000000.0 must be",
        ),
        (("world_size: 4,", "world_size: 1000000000,"), "measured_at.world_size=1000000000"),
        (("batch_size: 64", "batch_size: 1e3"), "measured_at.batch_size=1000.0 must be an integer"),
        (
            ("grad_workers: 4", "grad_workers: true"),
            "measured_at.grad_workers=True must be an integer",
        ),
        (("device: test bench", "device: [a, b]"), "device must be text, got list"),
        (("model: small_cnn", "model: 50"), "model must be text, got int"),
        (("placement: lpt", "placement: [lpt]"), "placement must be text"),
        (("device: test bench", "device: test bench\nbogus: 1"), "unknown key bogus"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(
    edit: tuple[str, str], named: str, tmp_path: Path
) -> None:
    assert edit[0] in GOOD
    assert named in refusal(tmp_path, GOOD.replace(edit[0], edit[1], 1))


def test_the_world_size_bound_is_the_planners(tmp_path: Path) -> None:
    at = f"world_size: {MAX_WORLD_SIZE},"
    ok = GOOD.replace("world_size: 4,", at).replace("grad_workers: 4", "grad_workers: 1")
    assert load_profile(write(tmp_path, ok)).measured_at.world_size == MAX_WORLD_SIZE
    over = ok.replace(at, f"world_size: {MAX_WORLD_SIZE + 1},")
    assert f"<= {MAX_WORLD_SIZE}" in refusal(tmp_path, over)


def _bomb(levels: int) -> str:
    """The billion-laughs shape: each level a list of nine references to the one below."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(lines) + f"\ndevice: *l{levels - 1}\n"


def test_an_alias_bomb_in_device_is_one_line_not_memory_error(tmp_path: Path) -> None:
    """9^10 (3.5 billion) values if expanded; refused before anything is built, in bounded memory."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = refusal(tmp_path, _bomb(10) + GOOD.replace("device: test bench\n", ""))
    assert f"expand to more than {MAX_NODES:,} values" in message
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200_000  # a few MiB at most; expanding would need gigabytes


def test_small_aliases_are_read_and_words_must_still_be_words(tmp_path: Path) -> None:
    text = GOOD.replace("device: test bench", "name: &n test bench\ndevice: *n")
    path = write(tmp_path, text)
    assert load_yaml(path, "x")["device"] == "test bench"
    # The alias itself is fine; the key 'name' is not a profile key.
    assert "unknown key name" in refusal(tmp_path, text)


def test_a_huge_or_deep_file_is_refused(tmp_path: Path) -> None:
    big = GOOD + "# " + "x" * (1 << 20) + "\n"
    assert "larger than 1024 KiB" in refusal(tmp_path, big)
    deep = "device: " + "[" * 5000 + "]" * 5000 + "\n"
    message = refusal(tmp_path, deep)
    assert "nested too deeply" in message or "must be text" in message
