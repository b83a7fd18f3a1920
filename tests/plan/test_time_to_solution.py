"""Time to solution: the network model and the step counts by hand, the profile file's checks, and the paper
check: with the paper's own V100 figures (profiles/paper_v100_resnet50.yaml) the projection gives SC20
Table III's 64-GPU times (SGD 178 min, K-FAC at interval 500 128 min) within 10 %."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from kfac_bench.errors import ConfigError
from kfac_bench.kfac import FactorReduction, Placement
from kfac_bench.plan.costs import Scenario, rank_loads
from kfac_bench.plan.length import RunLength, baseline_name, load_baseline, steps_per_epoch
from kfac_bench.plan.recipe import load_recipe
from kfac_bench.plan.stage_profile import load_profile
from kfac_bench.plan.time_to_solution import (
    GRAD_BUCKET_BYTES,
    Network,
    project,
    strategy_workers,
)
from kfac_bench.plan.tts_render import render_time_to_solution
from tests.harness.util import REPO

ALLREDUCE = FactorReduction.ALLREDUCE
PAPER = REPO / "profiles" / "paper_v100_resnet50.yaml"
CLUSTER = REPO / "profiles" / "cluster_v100_longhorn.yaml"


def copy_profile(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    """A profile written to ``tmp_path`` with the cluster file it names beside it."""
    (tmp_path / CLUSTER.name).write_text(CLUSTER.read_text())
    path = tmp_path / name
    path.write_text(text)
    return path


#: SC20 Table III (64 V100): minutes to the end of training.
TABLE_III = {"sgd": 178.0, "kfac_interval_100": 152.0, "kfac_interval_500": 128.0}


def test_ring_allreduce_and_tree_broadcast_by_hand() -> None:
    net = Network(10e9, 5e-6, "test")
    # 2(N-1)/N of the bytes through each rank, 2(N-1) latencies per call.
    assert net.allreduce(1e9, 4, 3) == pytest.approx(6 / 4 * 0.1 + 6 * 5e-6 * 3)
    assert net.reduce(1e9, 4) == pytest.approx(net.allreduce(1e9, 4) / 2)
    # ceil(log2 p) rounds of the whole payload.
    assert net.broadcast(1e9, 5, 2) == pytest.approx(3 * (0.1 + 2 * 5e-6))
    assert net.allreduce(1e9, 1) == net.broadcast(1e9, 1) == 0.0


def test_steps_per_epoch_follow_the_loader() -> None:
    # ImageNet on 64 GPUs at 32 each: 20,019 images per rank (padded), 625 full batches.
    assert steps_per_epoch(1_281_167, 64, 32, 1) == 625
    assert steps_per_epoch(1_281_167, 16, 32, 1) == 2502
    assert steps_per_epoch(100, 4, 10, 2) == 1  # 25 per rank, 2 micro-batches, one step
    arm = RunLength("r", "sgd", False, 90, None, 32, None, 1, 1_281_167, "imagenet")
    assert arm.steps(64) == (90 * 625, 625, "90 epochs × 625 steps")
    assert arm.global_batch(64) == 2048
    budget = RunLength("r", "lamb", False, 1000, 1563, 16, 32768, 1, None, "bert_shards")
    assert budget.steps(64)[0] == 1563 and budget.global_batch(64) == 32768
    unknown = RunLength("r", "sgd", False, 5, None, 2, None, 1, None, "coco")
    steps, _, why = unknown.steps(8)
    assert steps is None and "plan.dataset_size" in why
    assert baseline_name("resnet50_imagenet_smoke", "sgd") == "resnet50_imagenet_sgd_smoke"


def test_strategy_workers() -> None:
    assert [strategy_workers(s, 16, "comm_opt") for s in ("comm_opt", "mem_opt", "hybrid_opt")] == [
        16,
        1,
        8,
    ]
    assert strategy_workers("hybrid_opt", 16, "0.25") == 4  # the recipe's own hybrid fraction
    with pytest.raises(ValueError, match="does not divide"):
        strategy_workers("hybrid_opt", 16, "0.375")


@pytest.fixture(scope="module")
def resnet50() -> tuple:
    """ResNet-50 under the paper's scaling rule (decompositions every 2000 ... 125 steps on 16 ... 256)."""
    args = ["+recipe=resnet50_imagenet", "kfac.reference_world_size=320"]
    planned = load_recipe(args)
    assert planned.length is not None
    return planned, load_baseline(args, planned.length)


def _paper(resnet50: tuple, worlds: list[int]) -> tuple[list[dict], dict]:
    planned, baseline = resnet50
    profile = load_profile(PAPER)
    assert profile.bandwidth_bytes is not None and profile.latency_s is not None
    net = Network(profile.bandwidth_bytes, profile.latency_s, "paper profile")
    assert planned.length is not None
    return project(planned, planned.length, baseline, profile, net, worlds)


def test_the_paper_profile_gives_table_iii_at_64_gpus(resnet50: tuple) -> None:
    entries, info = _paper(resnet50, [64])
    at = {e["arm"]: e for e in entries}
    sgd, kfac = at["sgd"], at["comm_opt"]
    # The arms' own recipes: 90 SGD epochs, 55 K-FAC epochs, 625 steps of 2048 images each.
    assert (sgd["epochs"], kfac["epochs"], sgd["steps_per_epoch"]) == (90, 55, 625)
    assert kfac["intervals"] == [50, 500] and kfac["grad_workers"] == 64
    assert sgd["minutes"] == pytest.approx(TABLE_III["sgd"], rel=0.10)
    assert kfac["minutes"] == pytest.approx(TABLE_III["kfac_interval_500"], rel=0.10)
    # Where K-FAC's time goes (Fig. 7's stages amortised): at the profile's own configuration every
    # compute stage is Fig. 7's value, but the decompositions, which follow the Σn³ of the busiest rank
    # under LPT (the recipe) rather than round robin (the SC20 code that Fig. 7 measured).
    per = kfac["stages_s_per_step"]
    assert per["precondition"] == pytest.approx(0.020) and per["kl_clip"] == pytest.approx(0.005)
    assert per["factor"] == pytest.approx(0.092 / 50)
    ref = info["reference"]
    planned, _ = resnet50
    busiest = {
        p: max(
            rank_loads(
                planned.layers, planned.settings, Scenario(64, 64, p, ALLREDUCE)
            ).decomposition_cost
        )
        for p in (Placement.LPT, Placement.ROUND_ROBIN)
    }
    lpt_over_rr = busiest[Placement.LPT] / busiest[Placement.ROUND_ROBIN]
    assert per["decomposition"] == pytest.approx(1.341 * lpt_over_rr / 500)
    # The baseline's compute is the profile's step less the modelled allreduce, so the SGD step at the
    # profile's world size is the profile's step: the SGD figure checks the step count, not the model.
    assert sgd["step_s"] == pytest.approx(0.18987)
    assert ref["gradient_allreduce_calls"] == math.ceil(25_557_032 * 4 / GRAD_BUCKET_BYTES)
    # K-FAC's network stages are the model's, not the profile's measured ones (shown beside them).
    assert kfac["stages_s"]["factor_comm"] == pytest.approx(ref["modelled_comm_s"]["factor_comm"])
    assert ref["profiled_comm_s"]["factor_comm"] == 0.095


def test_the_recipe_as_it_trains_gives_table_iii_interval_100() -> None:
    """Without the scaling rule the recipe decomposes every 100 steps (factors every 10) at any N: Table
    III's interval-100 column, a second point of the same model with no constant changed."""
    args = ["+recipe=resnet50_imagenet"]
    planned = load_recipe(args)
    assert planned.length is not None
    entries, _ = _paper((planned, load_baseline(args, planned.length)), [64])
    kfac = next(e for e in entries if e["arm"] == "comm_opt")
    assert kfac["intervals"] == [10, 100]
    assert kfac["minutes"] == pytest.approx(TABLE_III["kfac_interval_100"], rel=0.10)


def test_projection_across_world_sizes(resnet50: tuple) -> None:
    worlds = [16, 32, 64, 128, 256]
    entries, info = _paper(resnet50, worlds)
    assert [e["world_size"] for e in entries] == [n for n in worlds for _ in range(4)]
    assert [e["arm"] for e in entries[:4]] == ["sgd", "comm_opt", "mem_opt", "hybrid_opt"]
    kfac = [e for e in entries if e["arm"] == "comm_opt"]
    # Constant K-FAC updates per epoch: the paper's decomposition intervals.
    assert [e["intervals"][1] for e in kfac] == [2000, 1000, 500, 250, 125]
    for e in entries:
        assert e["minutes"] == pytest.approx(e["steps"] * e["step_s"] / 60)
        assert e["step_s"] == pytest.approx(sum(e["stages_s_per_step"].values()))
        if e["arm"] != "sgd":
            base = next(
                b for b in entries if b["arm"] == "sgd" and b["world_size"] == e["world_size"]
            )
            assert e["less_time_than_baseline"] == pytest.approx(1 - e["minutes"] / base["minutes"])
    # Scaling efficiency against 16 GPUs; MEM-OPT's every-step gradient broadcast scales worst.
    first = kfac[0]
    assert kfac[3]["scaling_efficiency"] == pytest.approx(
        first["minutes"] * 16 / (kfac[3]["minutes"] * 128)
    )
    last = {e["arm"]: e["scaling_efficiency"] for e in entries if e["world_size"] == 256}
    assert last["mem_opt"] < last["comm_opt"] < last["sgd"] <= 1
    text = render_time_to_solution({"time_to_solution": entries, "time_to_solution_model": info})
    assert "12/125" in text and "factor_comm" in text and text.count("\n") >= 8


def test_time_to_solution_bars(resnet50: tuple) -> None:
    from kfac_bench.plan.plot import _time_bars

    entries, info = _paper(resnet50, [16, 64])
    ax = Figure().subplots()
    _time_bars(ax, {"recipe": "r", "time_to_solution": entries, "time_to_solution_model": info})
    heights = [round(b.get_height(), 6) for b in ax.patches]
    # One bar per arm per world size, grouped by arm as Fig. 8's legend: sgd at 16, 64, comm_opt ...
    order = [(e["arm"], e["world_size"]) for e in entries]
    by_arm = sorted(order, key=lambda k: ["sgd", "comm_opt", "mem_opt", "hybrid_opt"].index(k[0]))
    minutes = {(e["arm"], e["world_size"]): e["minutes"] for e in entries}
    assert heights == [round(minutes[k], 6) for k in by_arm]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "64"]


def test_a_profile_of_another_model_is_refused(resnet50: tuple, tmp_path: Path) -> None:
    other = copy_profile(
        tmp_path, PAPER.read_text().replace("model: resnet50", "model: cifar_resnet8")
    )
    planned, baseline = resnet50
    profile = load_profile(other)
    with pytest.raises(ConfigError, match="measured on model 'cifar_resnet8'"):
        project(planned, planned.length, baseline, profile, Network(1e9, 0, "t"), [8])


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("baseline_step_s:\n  value: 0.18987", "baseline_step_s:\n  value: -1"),
            "must be a finite number >= 0",
        ),
        (("  kl_clip:\n", "  kl_clop:\n"), "unknown stage stages_s.kl_clop"),
        (("  grad_workers: 64", "  grad_workers: 48"), "does not divide world_size=64"),
        (("placement: round_robin", "placement: spiral"), "measured_at.placement='spiral'"),
        (("model: resnet50\n", "model: resnet50\n: ["), "not a readable YAML file"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_key(
    edit: tuple[str, str], expected: str, tmp_path: Path
) -> None:
    text = PAPER.read_text()
    assert edit[0] in text
    bad = copy_profile(tmp_path, text.replace(edit[0], edit[1], 1), "bad.yaml")
    with pytest.raises(ConfigError, match=None) as err:
        load_profile(bad)
    message = str(err.value)
    assert expected in message and "\n" not in message and str(bad) in message


@pytest.mark.parametrize(
    "name",
    [
        "paper_v100_resnet50",
        "paper_v100_resnet50_kaisa",
        "paper_v100_resnet101",
        "paper_v100_resnet152",
        "paper_v100_maskrcnn",
        "paper_a100_bert_large_phase2",
    ],
)
def test_every_shipped_profile_gives_a_source_for_every_value(name: str) -> None:
    profile = load_profile(REPO / "profiles" / f"{name}.yaml")
    values = ["baseline_step_s", *(f"stages_s.{k}" for k in profile.stages_s)]
    values += ["network.bandwidth_gb_s", "network.latency_us"]
    assert sorted(profile.sources) == sorted(values)
    assert all(len(s) > 20 for s in profile.sources.values())
    # Models named as users name them; the V100 ResNets share one cluster, every value of it sourced.
    assert profile.model == name.split("_", 2)[2].removesuffix("_phase2").removesuffix("_kaisa")
    if "resnet" in name and "kaisa" not in name:
        assert profile.cluster is not None
        assert set(profile.cluster.sources) == {
            "reference.gradient_bytes",
            "reference.every_step_s",
            "baseline_growth_s",
            "kfac_growth",
            "spread",
        }


def test_a_small_recipe_with_a_profile_of_its_own(tmp_path: Path) -> None:
    """digits (1438 training images, a global batch of 256) against a world-1 profile without network
    figures: the arms' epochs come from digits and digits_sgd, and 8 GPUs split the same batch (32 each)
    rather than growing it, so an epoch has the same steps; a batch that does not fit is not projected."""
    profile_path = tmp_path / "digits.yaml"
    profile_path.write_text(
        "model: small_cnn\nprecision: bf16\n"
        "measured_at: {world_size: 1, batch_size: 256, grad_workers: 1, placement: lpt}\n"
        "baseline_step_s: {value: 0.004, source: a made-up step}\n"
        "stages_s: {factor: 0.001, decomposition: 0.002, precondition: 0.0005, kl_clip: 0.0001}\n"
    )
    planned = load_recipe(["+recipe=digits"])
    assert planned.length is not None
    baseline = load_baseline(["+recipe=digits"], planned.length)
    assert (baseline.recipe, baseline.kfac, baseline.examples) == ("digits_sgd", False, 1438)
    net = Network(1e9, 0.0, "test")
    entries, info = project(
        planned, planned.length, baseline, load_profile(profile_path), net, [1, 2, 8]
    )
    one = {e["arm"]: e for e in entries if e["world_size"] == 1}
    # World 1: no communication; the step is the profile's (256 examples per step, as measured).
    assert one["sgd"]["step_s"] == pytest.approx(0.004)
    assert one["sgd"]["steps"] == baseline.epochs * (1438 // 256)
    f, k = planned.settings.intervals(1)
    assert one["comm_opt"]["step_s"] == pytest.approx(
        0.004 + 0.0005 + 0.0001 + 0.001 / f + 0.002 / k
    )
    eight = {e["arm"]: e for e in entries if e["world_size"] == 8}
    assert eight["sgd"]["steps"] == one["sgd"]["steps"]  # 180 examples per rank, 5 steps of 32
    assert (
        eight["sgd"]["step_s"] < one["sgd"]["step_s"]
    )  # an eighth of the compute, plus an allreduce
    # With the recipe's per-rank batch made the experiment's (no global batch), 8 GPUs hold no step.
    grown = load_recipe(["+recipe=digits", "train.global_batch_size=null"])
    assert grown.length is not None
    entries, info = project(grown, grown.length, baseline, load_profile(profile_path), net, [1, 8])
    assert all(
        e["minutes"] is None and "holds no step" in e["reason"]
        for e in entries
        if e["world_size"] == 8 and e["arm"] != "sgd"
    )
    text = render_time_to_solution({"time_to_solution": entries, "time_to_solution_model": info})
    assert "holds no step at 8 GPUs" in text
    assert "measured in bf16, the recipe trains in fp32" in text
