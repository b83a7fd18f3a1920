"""What the papers derive from ResNet-50's layer shapes, recomputed by the planner from the full-size model.

SC20 §VI-C4: round-robin placement leaves the workers' factor elements imbalanced by about 19x at 16 GPUs and
by over 1000x at 64; the largest factor is 4608 x 4608 (a layer-4 3x3 convolution, 512 · 9), so no placement
can bring the busiest worker's Σ n³ below 4608³ ≈ 9.78e10, against an ideal total/16 ≈ 2.83e10 (SC20
Tables V-VI discuss the resulting eigendecomposition imbalance). KAISA Table 5 (§5.5): the K-FAC memory at the
largest gradient-worker fraction is 1.5-2.9x the one at the smallest.
"""

from __future__ import annotations

import pytest
import torch

from kfac_bench.kfac import FactorReduction, Placement
from kfac_bench.plan.costs import Scenario, rank_loads
from kfac_bench.plan.recipe import PlannedModel, load_recipe
from kfac_bench.plan.reference import TABLE5, reference_memory, table5_comparison
from kfac_bench.plan.timing import NOMINAL_V100


@pytest.fixture(scope="module")
def resnet50() -> PlannedModel:
    return load_recipe(["+recipe=resnet50_imagenet"])


def loads(planned: PlannedModel, world: int, placement: Placement, grad_workers: int | None = None):
    scenario = Scenario(world, grad_workers or world, placement, FactorReduction.ALLREDUCE)
    return rank_loads(planned.layers, planned.settings, scenario)


def test_resnet50_has_the_factor_sizes_the_papers_count(resnet50: PlannedModel) -> None:
    dims = sorted(d for s in resnet50.layers for d in (s.a_dim, s.g_dim))
    assert len(resnet50.layers) == 54  # 53 convolutions + fc
    assert dims[-1] == 4608 == 512 * 3 * 3
    assert (
        dims[0] == 64
    )  # the slides' "smallest 128x128" counts conv1's A (3·7·7 = 147) as the smallest


@pytest.mark.parametrize("world", [16, 64])
def test_lpt_makespan_is_bounded_below_by_the_largest_factor(
    resnet50: PlannedModel, world: int
) -> None:
    for grad_workers in (1, world):
        cost = loads(resnet50, world, Placement.LPT, grad_workers).decomposition_cost
        ideal = sum(cost) / world
        assert max(cost) >= 4608**3 > ideal
    assert pytest.approx(9.78e10, rel=1e-3) == 4608**3
    if world == 16:
        assert ideal == pytest.approx(2.83e10, rel=2e-3)
    # Colocated factors: the busiest rank holds exactly the 4608 layer (A 4608², G 512²) and nothing else,
    # since that layer alone exceeds what an ideal share would be.
    assert max(cost) == 4608**3 + 512**3


def test_round_robin_reproduces_sc20s_factor_element_imbalance(resnet50: PlannedModel) -> None:
    sixteen = loads(resnet50, 16, Placement.ROUND_ROBIN).factor_elements
    sixty_four = loads(resnet50, 64, Placement.ROUND_ROBIN).factor_elements
    assert max(sixteen) / min(sixteen) == pytest.approx(19, abs=0.5)  # "about 19x"
    assert max(sixty_four) / min(sixty_four) > 1000  # "over 1000x"
    # LPT on n³ balances the same elements far better (it cannot beat the 4608² factor, though).
    lpt = loads(resnet50, 16, Placement.LPT).factor_elements
    assert max(lpt) / min(lpt) < max(sixteen) / min(sixteen) / 3


def test_nominal_decomposition_rate_is_sc20_table_v_over_the_round_robin_makespan(
    resnet50: PlannedModel,
) -> None:
    makespan = max(loads(resnet50, 16, Placement.ROUND_ROBIN).decomposition_cost)
    # SC20 Table V: ResNet-50, 16 GPUs, eigendecomposition T_comp 2256.64 ms (SC20's round robin).
    assert NOMINAL_V100.decomposition_s_per_n3 * makespan == pytest.approx(2.25664, rel=1e-9)


def test_reference_layout_counts_what_the_kaisa_code_allocates(resnet50: PlannedModel) -> None:
    """Hand count for the fc layer alone (A 2049, G 1000) on 2 ranks: FP32 factors, the preconditioned
    gradient everywhere; Q_A, Q_G, dGdA on gradient workers; dA, dG on the decomposing rank only."""
    fc = [s for s in resnet50.layers if s.name == "fc"]
    a, g = 2049, 1000
    mem = reference_memory(fc, 2, 1, torch.float32)  # MEM-OPT: one gradient worker
    assert mem["factors"] == 4 * (a * a + g * g)
    assert mem["preconditioned_gradients"] == 4 * g * a
    assert mem["decompositions"] == 4 * (a * a + g * g + g * a + a + g)
    assert mem["outer_products"] == 4 * g * a
    half = reference_memory(fc, 2, 1, torch.float16)
    assert half["factors"] == mem["factors"] // 2


@pytest.mark.parametrize(
    "overrides",
    [
        ["+recipe=resnet50_imagenet"],
        ["+recipe=maskrcnn_coco"],
        ["+recipe=bert_large_pretrain_phase2"],
    ],
)
def test_reference_layout_overhead_grows_by_the_factor_kaisa_measured(overrides: list[str]) -> None:
    """KAISA Table 5: the largest-fraction overhead is 1.5-2.9x the smallest one's, over its six models.

    Tolerance: the paper's own range, not each model's own ratio (ResNet-50 2.91, Mask R-CNN 1.96, BERT-Large
    2.91). The measured MB are allocator peaks, which add transients no layout predicts (im2col patches,
    eigensolver workspaces, cached blocks) and which differ between the two ends of a row; what a layout
    determines is how the persistent state grows with the fraction, and that must stay within the range
    the paper reports. The per-model ratios are in docs/plan.md."""
    cmp = table5_comparison(load_recipe(overrides))
    assert cmp is not None
    assert 1.5 <= cmp["ratio"]["reference"] <= 2.9, cmp["ratio"]
    paper = TABLE5[
        {"ResNet-50": "resnet50", "Mask R-CNN": "maskrcnn", "BERT-Large": "bert_large"}[
            cmp["model"]
        ]
    ]
    assert cmp["ratio"]["paper"] == pytest.approx(paper.ratio)
