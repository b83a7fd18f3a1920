"""The planner against the paper's scaling study: TPDS Fig. 8 (minutes of SGD, K-FAC-opt = COMM-OPT and
K-FAC-lw = MEM-OPT for ResNet-50/101/152 at 16-256 V100s) and SC20 Table IV (K-FAC-opt's saving over SGD).

The inputs: each model's profile (SC20 Tables III and V, TPDS Fig. 7: 64 GPUs only) and the cluster file,
read off ResNet-50's Fig. 8 bars alone (its derivation is recomputed here). ResNet-101 and -152, and every
K-FAC-lw bar, are predictions.
"""

from __future__ import annotations

import math
import statistics
from functools import cache

import pytest
import yaml

from kfac_bench.plan.calibrate import cluster_growth
from kfac_bench.plan.length import load_baseline
from kfac_bench.plan.recipe import load_recipe
from kfac_bench.plan.stage_profile import load_profile
from kfac_bench.plan.time_to_solution import BAND_Z, Network, project
from tests.harness.util import REPO

NS = (16, 32, 64, 128, 256)
MODELS = ("resnet50", "resnet101", "resnet152")
#: TPDS Fig. 8 bar labels, minutes (= SC20 Figs. 7-9).
FIG8 = {
    "resnet50": {
        "sgd": (567, 303, 178, 102, 71),
        "comm_opt": (449, 243, 133, 78, 58),
        "mem_opt": (468, 256, 144, 93, 69),
    },
    "resnet101": {
        "sgd": (926, 480, 255, 154, 96),
        "comm_opt": (756, 427, 216, 124, 87),
        "mem_opt": (825, 448, 243, 156, 119),
    },
    "resnet152": {
        "sgd": (1218, 625, 339, 202, 120),
        "comm_opt": (1118, 578, 319, 192, 133),
        "mem_opt": (1171, 635, 362, 230, 160),
    },
}
#: SC20 Table IV: K-FAC-opt's improvement over SGD, %.
TABLE_IV = {
    "resnet50": (20.9, 19.7, 25.2, 23.5, 17.7),
    "resnet101": (18.4, 11.1, 15.1, 19.5, 9.7),
    "resnet152": (8.2, 7.6, 6.0, 4.9, -11.1),
}
#: SC20 Table III (64 V100): SGD and K-FAC at interval 500, minutes; Fig. 8 measured the same again.
TABLE_III = {"resnet50": (178, 128), "resnet101": (244, 197), "resnet152": (345, 310)}


def args(model: str) -> list[str]:
    return ["+recipe=resnet50_imagenet", "kfac.reference_world_size=320", f"model.arch={model}"]


@cache
def arms(model: str) -> tuple:
    planned = load_recipe(args(model))
    assert planned.length is not None
    return planned, load_baseline(args(model), planned.length)


@cache
def projection(model: str) -> dict[tuple[int, str], dict]:
    planned, baseline = arms(model)
    profile = load_profile(REPO / "profiles" / f"paper_v100_{model}.yaml")
    assert profile.bandwidth_bytes is not None and profile.latency_s is not None
    net = Network(profile.bandwidth_bytes, profile.latency_s, "profile")
    entries, _ = project(planned, planned.length, baseline, profile, net, list(NS))
    return {(e["world_size"], e["arm"]): e for e in entries}


def test_the_cluster_file_is_what_resnet50s_bars_give() -> None:
    """Every growth value of profiles/cluster_v100_longhorn.yaml is recomputed from Fig. 8's ResNet-50 bars
    and the ResNet-50 profile (without its cluster): nothing in it was set by hand."""
    planned, baseline = arms("resnet50")
    profile = load_profile(REPO / "profiles" / "paper_v100_resnet50.yaml")
    assert profile.cluster is not None and profile.bandwidth_bytes and profile.latency_s is not None
    bare = type(profile)(**{**vars(profile), "cluster": None})
    net = Network(profile.bandwidth_bytes, profile.latency_s, "profile")
    bars = {
        n: (FIG8["resnet50"]["sgd"][i], FIG8["resnet50"]["comm_opt"][i]) for i, n in enumerate(NS)
    }
    got = cluster_growth(planned, bare, net, planned.length, baseline, bars)
    cluster = profile.cluster
    for n in NS:
        assert cluster.baseline_growth_s[n] == pytest.approx(got["baseline_growth_s"][n], abs=1e-5)
        assert cluster.kfac_growth[n] == pytest.approx(got["kfac_growth"][n], abs=1e-5)
    # The every-step reference is the ResNet-50 profile's own (Fig. 7: precondition + scale gradients).
    st = profile.stages_s
    assert cluster.reference_every_step_s == pytest.approx(st["precondition"] + st["kl_clip"])
    assert cluster.reference_gradient_bytes == planned.scan.coverage().trainable_params * 4


def test_the_spread_is_the_papers_repeated_measurements() -> None:
    """Table III and Fig. 8 measured the same 64-GPU configurations twice: the RMS of the six relative
    differences is the cluster's spread."""
    pairs = []
    for model, (sgd, kfac) in TABLE_III.items():
        pairs += [(sgd, FIG8[model]["sgd"][2]), (kfac, FIG8[model]["comm_opt"][2])]
    rms = math.sqrt(statistics.mean((2 * (a - b) / (a + b)) ** 2 for a, b in pairs))
    doc = yaml.safe_load((REPO / "profiles" / "cluster_v100_longhorn.yaml").read_text())
    assert doc["spread"]["value"] == pytest.approx(rms, abs=5e-5)


CELLS = [(m, i) for m in MODELS for i in range(len(NS))]


@pytest.mark.parametrize(("model", "i"), CELLS)
def test_comm_opts_saving_is_within_8_points_of_table_iv(model: str, i: int) -> None:
    e = projection(model)[(NS[i], "comm_opt")]
    saving = 100 * e["less_time_than_baseline"]
    assert abs(saving - TABLE_IV[model][i]) <= 8, (model, NS[i], saving)


def test_resnet152_at_256_gpus_is_slower_with_kfac_as_measured() -> None:
    at = projection("resnet152")
    assert at[(256, "comm_opt")]["minutes"] > at[(256, "sgd")]["minutes"]
    # ... while ResNet-50 and -101 stay faster with K-FAC at every scale, as measured.
    for model in ("resnet50", "resnet101"):
        for n in NS:
            assert projection(model)[(n, "comm_opt")]["less_time_than_baseline"] > 0


def _coverage(shrink: float = 1.0) -> tuple[int, list[float]]:
    """Fig. 8 cells inside the band (each side's width beyond the minutes scaled by ``shrink``), and the
    band's relative half-widths."""
    inside, widths = 0, []
    for model in MODELS:
        for arm, bars in FIG8[model].items():
            for n, measured in zip(NS, bars):
                e = projection(model)[(n, arm)]
                low = e["minutes"] - shrink * (e["minutes"] - e["minutes_low"])
                high = e["minutes"] + shrink * (e["minutes_high"] - e["minutes"])
                inside += low <= measured <= high
                widths.append((e["minutes_high"] - e["minutes_low"]) / (2 * e["minutes"]))
    return inside, widths


def test_fig8_minutes_fall_inside_the_band_in_most_cells() -> None:
    inside, widths = _coverage()
    assert inside >= math.ceil(0.8 * 45), inside
    # The band is meant to hold 90 % of measurements (1.645 sigma of the paper's own spread): it holds
    # 40 of 45 here, and its median half-width is what docs/plan.md states.
    assert inside <= 45
    assert statistics.median(widths) == pytest.approx(0.108, abs=0.005)


def test_the_band_is_no_wider_than_it_needs_to_be() -> None:
    """A band 1/1.645 as wide (one standard deviation where it takes 1.645) would hold fewer than 80 % of
    the cells: the width is what the coverage needs."""
    for model in MODELS:
        for n in NS:
            e = projection(model)[(n, "sgd")]
            assert e["minutes_low"] < e["minutes"] < e["minutes_high"]
    narrow, _ = _coverage(shrink=1 / BAND_Z)
    assert narrow < math.ceil(0.8 * 45), narrow


def test_kaisa_fig6_iteration_times_fall_inside_the_band() -> None:
    """KAISA Fig. 6 (ResNet-50, 64 V100, ~ read off the plot): SGD 0.150 s (the profile's input), MEM-OPT
    (fraction 1/64) ~0.235 s and COMM-OPT ~0.177 s per iteration: the K-FAC steps are predictions from TPDS
    Fig. 7's stages on KAISA's SGD step."""
    planned, baseline = arms("resnet50")
    profile = load_profile(REPO / "profiles" / "paper_v100_resnet50_kaisa.yaml")
    assert profile.bandwidth_bytes is not None and profile.latency_s is not None
    net = Network(profile.bandwidth_bytes, profile.latency_s, "profile")
    entries, _ = project(planned, planned.length, baseline, profile, net, [64])
    at = {e["arm"]: e for e in entries}
    for arm, measured in (("sgd", 0.150), ("comm_opt", 0.177), ("mem_opt", 0.235)):
        e = at[arm]
        low, high = (e["step_s"] * e[k] / e["minutes"] for k in ("minutes_low", "minutes_high"))
        assert low <= measured <= high, (arm, e["step_s"], measured)
    assert at["sgd"]["step_s"] < at["comm_opt"]["step_s"] < at["mem_opt"]["step_s"]


def test_the_split_of_kfacs_growth_agrees_with_all_three_models_bars() -> None:
    """A check the model never sees: read per world size across ResNet-50, -101 and -152's own Fig. 8
    bars, the every-step work is a + h x the model's 64-GPU value with (least squares) h below 1 and a few
    tens of ms the same for every model at 16 and 32 GPUs, and h near ResNet-50's ratio, a near 0, at 128
    and 256: seconds below the reference world size, a stretch above it, as the central reading takes it
    (docs/plan.md, "Where they part")."""
    every = {}
    for model in MODELS:
        planned, baseline = arms(model)
        profile = load_profile(REPO / "profiles" / f"paper_v100_{model}.yaml")
        assert profile.bandwidth_bytes and profile.latency_s is not None
        bare = type(profile)(**{**vars(profile), "cluster": None})
        net = Network(profile.bandwidth_bytes, profile.latency_s, "profile")
        bars = {n: (FIG8[model]["sgd"][i], FIG8[model]["comm_opt"][i]) for i, n in enumerate(NS)}
        got = cluster_growth(planned, bare, net, planned.length, baseline, bars)
        every[model] = got["every_step_s"]
    fit = {}
    for n in NS:
        xs = [every[m][64] for m in MODELS]
        ys = [every[m][n] for m in MODELS]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        h = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fit[n] = (h, my - h * mx)
    assert fit[16] == pytest.approx((0.815, 0.0109), abs=2e-3)
    assert fit[32] == pytest.approx((0.792, 0.0261), abs=2e-3)
    assert fit[128] == pytest.approx((1.174, -0.0130), abs=2e-3)
    assert fit[256] == pytest.approx((1.894, -0.0150), abs=2e-3)
    growth = load_profile(REPO / "profiles" / "paper_v100_resnet50.yaml").cluster
    assert growth is not None
    for n in (128, 256):
        assert fit[n][0] == pytest.approx(growth.kfac_growth[n], abs=0.07)
