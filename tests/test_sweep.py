"""`shardwise sweep`: the vectorized core equals the scalar planner, the Pareto front equals a
brute-force reference, constraints exclude what they should, output is deterministic, and the
CLI answers the issue's questions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli
from shardwise.commands.sweep import to_csv
from shardwise.errors import ShardwiseError
from shardwise.perf import core, grid
from shardwise.perf.configurations import link_capacity, quant_variants
from shardwise.perf.decode import layout_table
from shardwise.perf.estimate import Scenario, decode_speed, estimate, formats_bits, hardware_of, prefill_speed
from shardwise.perf.memory import memory_fit
from shardwise.perf.pareto import pareto_mask
from shardwise.perf.sweep import SweepRequest, draft_terms, run_sweep
from shardwise.perf.profiles import get_profile
from shardwise.perf.scenario import build_request, parse_counts
from shardwise.plan import ParallelPlan, validate_plan
from shardwise.spec.hardware import get_box, get_link
from shardwise.spec.parse import load_model

GB = 1e9


def _plans(model, n: int) -> list[ParallelPlan]:
    out = []
    for tp in range(1, n + 1):
        for ep in range(1, tp + 1):
            plan = ParallelPlan(tp=tp, ep=ep, pp=n // tp)
            if n % tp or plan.world_size != n:
                continue
            try:
                validate_plan(model, plan)
            except ShardwiseError:
                continue
            out.append(plan)
    return out


# ---- the core equals the scalar model -----------------------------------------------------------


@pytest.mark.parametrize("model_name", ["kimi-k3", "gpt-oss-20b", "llama-3.1-8b", "qwen3.5-397b-a17b", "deepseek-v2-lite"])
@pytest.mark.parametrize("box_name,link_name", [("dgx-spark", "100g-roce"), ("raspberry-pi-5-8gb", "1gbe-tcp"),
                                                ("h100-sxm", "nvlink4")])
def test_core_equals_scalar_planner(model_name, box_name, link_name):
    """Decode tok/s (plain and speculative), fullest-rank memory and prefill tok/s equal the
    scalar planner for every layout on 1, 2, 4 and 8 boxes, memory-bound (dgx-spark, h100) and
    compute-bound (a Raspberry Pi at 32k context) alike."""
    model = load_model(model_name)
    box, link = get_box(box_name), get_link(link_name)
    prof = get_profile("vllm")
    formats = model.group_formats()
    bits = formats_bits(formats, model)
    plans = [p for n in (1, 2, 4, 8) for p in _plans(model, n)]
    table = core.build_layout_table(model, plans, bits)
    idx = np.arange(len(plans))
    hw = hardware_of(box, link, prof)
    context = 32768
    compute_bound = 0
    for spec_tokens in (0, 7):
        out = grid.evaluate(model, table, idx, hw, box.memory_gb * GB, context, profile=prof,
                            spec_tokens=spec_tokens, acceptance=0.8)
        pre = grid.evaluate_prefill(model, table, idx, hw, 2048, profile=prof)
        for i, plan in enumerate(plans):
            sc = Scenario(model=model, box=box, boxes=plan.world_size, link=link, plan=plan, formats=formats,
                          profile=prof, context_tokens=context, spec_tokens=spec_tokens,
                          acceptance=0.8 if spec_tokens else 0.0)
            tok, _, final, _ = decode_speed(sc)
            assert out["tok_per_s"][i] == pytest.approx(tok, rel=1e-12), plan
            assert out["memory_s"][i] == pytest.approx(final.memory_s, rel=1e-12)
            assert out["compute_s"][i] == pytest.approx(final.compute_s, rel=1e-12)
            compute_bound += final.compute_s > final.memory_s
            box_bytes = box.memory_gb * GB
            assert bool(out["fits"][i]) == memory_fit(model, plan, bits, context, 2.0, box_bytes, 0.10).fits
            if spec_tokens == 0:
                ref = prefill_speed(sc, layout_table(model, plan, bits, 2.0), hw)
                assert pre["tok_per_s"][i] == pytest.approx(ref["tok_per_s"], rel=1e-12)
    if box_name == "raspberry-pi-5-8gb":
        assert compute_bound, "the Pi case should exercise compute-bound steps"


@pytest.mark.parametrize("box_name,link_name", [("dgx-spark", "100g-roce"), ("h100-sxm", "nvlink4")])
def test_core_with_a_draft_model_equals_scalar_planner(box_name, link_name):
    """With a draft model the core's tok/s, memory fit and bottleneck equal the scalar planner's."""
    model, draft = load_model("llama-3.1-70b"), load_model("llama-3.1-8b")
    box, link = get_box(box_name), get_link(link_name)
    prof = get_profile("vllm")
    formats = model.group_formats()
    bits = formats_bits(formats, model)
    plans = [p for n in (2, 4, 8) for p in _plans(model, n)]
    table = core.build_layout_table(model, plans, bits)
    hw = hardware_of(box, link, prof)
    req = SweepRequest(models=("llama-3.1-70b",), boxes=(box,), counts=(2, 4, 8), links=(link,), runtime="vllm",
                       spec_tokens=4, acceptance=0.8, draft=draft)
    drafting, replicated = draft_terms(req, (box,))
    assert drafting[0] > 0 and replicated > draft.total_params * 2  # bf16 weights plus its cache
    out = grid.evaluate(model, table, np.arange(len(plans)), hw, box.memory_gb * GB, 4096, profile=prof,
                        spec_tokens=4, acceptance=0.8, drafting_s=drafting[0], replicated_bytes=replicated)
    for i, plan in enumerate(plans):
        sc = Scenario(model=model, box=box, boxes=plan.world_size, link=link, plan=plan, formats=formats,
                      profile=prof, spec_tokens=4, acceptance=0.8, draft=draft)
        doc = estimate(sc)
        assert out["tok_per_s"][i] == pytest.approx(doc["decode"]["tok_per_s"], rel=1e-12), plan
        assert out["free_bytes"][i] == pytest.approx(doc["memory"]["free_bytes"], rel=1e-9)
        assert bool(out["fits"][i]) == doc["memory"]["fits"]
        assert grid.BOTTLENECKS[int(out["bottleneck"][i])] == doc["decode"]["bottleneck"], plan
    assert "drafting" in {grid.BOTTLENECKS[int(b)] for b in out["bottleneck"]}, "a case where drafting dominates"


def test_core_memory_bytes_equal_scalar_fullest_rank():
    """The fullest rank's weights + cache equal ``memory.memory_fit`` at several contexts."""
    from shardwise.perf.memory import memory_fit

    model = load_model("gpt-oss-120b")  # sliding + full layers, fused experts
    bits = formats_bits(model.group_formats(), model)
    plans = [p for n in (1, 3, 4, 6) for p in _plans(model, n)]
    table = core.build_layout_table(model, plans, bits)
    for ctx in (1, 100, 128, 5000, 131072):
        fullest = core.fullest_rank_bytes(table, ctx)
        for i, plan in enumerate(plans):
            fit = memory_fit(model, plan, bits, ctx, 2.0, 128 * GB)
            assert fullest[i] == pytest.approx(fit.weights_bytes + fit.kv_bytes, rel=1e-12)


# ---- Pareto --------------------------------------------------------------------------------------


def _dominates(a, b) -> bool:
    return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))


def _brute_front(points: list[tuple]) -> set[int]:
    return {i for i, p in enumerate(points) if not any(_dominates(q, p) for q in points)}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*(st.integers(0, 6),) * 3), min_size=0, max_size=700))
def test_pareto_mask_equals_brute_force(points):
    """With many ties (small integers) and more rows than one block."""
    mask = pareto_mask(np.array(points, dtype=float).reshape(len(points), 3))
    assert set(np.flatnonzero(mask)) == _brute_front(points)


GRID = dict(models=("llama-3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b"),
            boxes=("dgx-spark", "mac-mini-m4-pro-64", "rtx-4090", "strix-halo-128"),
            links=("10gbe-tcp", "100g-roce", "tb5-rdma", "pcie4-x16", "1gbe-tcp"), counts=(1, 2, 3, 4))


def _reference(constraints: dict) -> dict[tuple, float]:
    """Brute force: every configuration through the scalar planner, plain-Python dominance per model."""
    prof = get_profile("vllm")
    out: dict[tuple, float] = {}
    for model_name in GRID["models"]:
        model = load_model(model_name)
        points = []
        for variant in quant_variants(model, None, None):
            bits = formats_bits(variant.format_map, model)
            avg_bits = sum(n * bits[g] for g, n in model.params_by_group.items()) / model.total_params
            for n in GRID["counts"]:
                for plan in _plans(model, n):
                    for box_name in GRID["boxes"]:
                        box = get_box(box_name)
                        price = box.builder_price_usd or box.list_price_usd
                        for link_name in (None,) if n == 1 else GRID["links"]:
                            link = get_link(link_name) if link_name else None
                            if link is not None and n > link_capacity(box, link):
                                continue
                            if not memory_fit(model, plan, bits, 4096, 2.0, box.memory_gb * GB, 0.10).fits:
                                continue
                            switches = math.ceil(n / link.switch_ports) if link and link.switch_ports and n > 2 else 0
                            usd = n * price + switches * ((link.switch_price_usd or 0.0) if link else 0.0)
                            watts = n * box.load_watts + switches * ((link.switch_watts or 0.0) if link else 0.0)
                            sc_link = link or get_link("100g-roce")  # one box: no collectives, the link is unused
                            sc = Scenario(model=model, box=box, boxes=n, link=sc_link, plan=plan,
                                          formats=variant.format_map, profile=prof)
                            tok = decode_speed(sc)[0]
                            if constraints.get("budget_usd") and usd > constraints["budget_usd"]:
                                continue
                            if constraints.get("max_watts") and watts > constraints["max_watts"]:
                                continue
                            if constraints.get("min_tok_per_s") and tok < constraints["min_tok_per_s"]:
                                continue
                            key = (model_name, variant.label, box_name, n, link_name or "none", plan.tp, plan.ep, plan.pp)
                            points.append((key, (round(tok, 9), -usd, -watts, round(avg_bits, 12))))
        objectives = [p[1] for p in points]
        if len({o[3] for o in objectives}) == 1:
            objectives = [o[:3] for o in objectives]
        for i in _brute_front(objectives):
            out[points[i][0]] = points[i][1][0]
    return out


@pytest.mark.parametrize("constraints", [{}, {"budget_usd": 9000.0, "max_watts": 500.0}, {"min_tok_per_s": 60.0}])
def test_front_equals_brute_force(constraints):
    req = build_request(model=",".join(GRID["models"]), box=",".join(GRID["boxes"]), link=",".join(GRID["links"]),
                        boxes=",".join(map(str, GRID["counts"])), budget=constraints.get("budget_usd"),
                        max_watts=constraints.get("max_watts"), min_tok_per_s=constraints.get("min_tok_per_s"))
    result = run_sweep(req)
    got = {(r["model"], r["quant"], r["box"], r["boxes"], r["link"], r["tp"], r["ep"], r["pp"]): r["tok_per_s"]
           for r in result.rows}
    ref = _reference(constraints)
    assert set(got) == set(ref)
    for key, tok in ref.items():
        assert got[key] == pytest.approx(tok, rel=1e-9)
    for r in result.rows:
        assert r["usd"] <= constraints.get("budget_usd", math.inf)
        assert r["watts"] <= constraints.get("max_watts", math.inf)
        assert r["tok_per_s"] >= constraints.get("min_tok_per_s", 0.0)
    assert [r["tok_per_s"] for r in result.rows] == sorted((r["tok_per_s"] for r in result.rows), reverse=True)


def test_constraints_remove_exactly_the_violators():
    """The constrained sweep counts as feasible exactly the unconstrained fitting configurations
    within the limits, and its front is the front of those."""
    base = dict(model="llama-3.1-8b,qwen3-30b-a3b", box="dgx-spark,rtx-4090", boxes="1-4")
    free = run_sweep(build_request(**base))
    tight = run_sweep(build_request(**base, budget=8000.0, max_watts=700.0))
    assert tight.configurations == free.configurations
    assert tight.feasible < free.fitting
    assert all(r["usd"] <= 8000.0 and r["watts"] <= 700.0 for r in tight.rows)
    # a free-front row within the limits stays on the tighter front (nothing feasible dominated it before)
    within = {(r["model"], r["quant"], r["box"], r["boxes"], r["link"], r["layout"]) for r in free.rows
              if r["usd"] <= 8000.0 and r["watts"] <= 700.0}
    assert within <= {(r["model"], r["quant"], r["box"], r["boxes"], r["link"], r["layout"]) for r in tight.rows}


def test_same_sweep_twice_is_identical():
    req = build_request(model="kimi-k3,gpt-oss-120b", max_boxes=24, prefill=True)
    assert json.dumps(run_sweep(req).rows) == json.dumps(run_sweep(req).rows)


def test_prefill_objective_keeps_fast_prefill_rows():
    req = build_request(model="llama-3.1-70b", box="dgx-spark,h100-sxm", boxes="1-8", prefill=True)
    rows = run_sweep(req).rows
    assert all("prefill_tok_per_s" in r for r in rows)
    best_prefill = max(rows, key=lambda r: r["prefill_tok_per_s"])
    decode_only = run_sweep(build_request(model="llama-3.1-70b", box="dgx-spark,h100-sxm", boxes="1-8")).rows
    assert len(rows) >= len(decode_only)
    assert best_prefill["prefill_tok_per_s"] > 0


# ---- CLI -------------------------------------------------------------------------------------------


def test_kimi_budget_includes_or_explains_16_sparks():
    res = run_cli("sweep", "--model", "kimi-k3", "--budget", "120000", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    for key in ("model", "box", "boxes", "link", "tp", "ep", "pp", "tok_per_s", "usd", "watts", "bottleneck"):
        assert all(key in r for r in rows)
    assert all(r["usd"] <= 120000 for r in rows)
    check = [line for line in res.stderr.splitlines() if line.startswith("check: 16 x dgx-spark over 100g-roce")]
    assert len(check) == 1, res.stderr
    sparks = [r for r in rows if r["box"] == "dgx-spark" and r["boxes"] == 16 and r["link"] == "100g-roce"
              and r["quant"] == "native"]
    if sparks:
        assert "is on the front" in check[0]
    else:
        assert "is dominated by" in check[0]
    print(check[0])


def test_spark_4_ranks_models_that_fit():
    res = run_cli("sweep", "--box", "dgx-spark", "--boxes", "4", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert {r["box"] for r in rows} == {"dgx-spark"} and {r["boxes"] for r in rows} == {4}
    models = {r["model"] for r in rows}
    spark = get_box("dgx-spark")
    for name in ("llama-3.1-8b", "gpt-oss-120b", "kimi-k3"):
        model = load_model(name)
        any_fit = any(memory_fit(load_model(name), p, formats_bits(v.format_map, model), 4096, 2.0, spark.memory_gb * GB, 0.1).fits
                      for p in _plans(model, 4) for v in quant_variants(model, None, None))
        assert (name in models) == any_fit, name
    human = run_cli("sweep", "--box", "dgx-spark", "--boxes", "4")
    assert human.returncode == 0
    assert "Models ranked by decode tok/s" in human.stdout
    order = [line.split("│")[2].strip() for line in human.stdout.splitlines() if line.startswith("│") and "│ " in line]
    ranked = [m for m in order if m in models][: len(models)]
    best = {}
    for r in rows:
        best[r["model"]] = max(best.get(r["model"], 0.0), r["tok_per_s"])
    assert ranked == sorted(best, key=lambda m: -best[m])


def test_csv_matches_json():
    args = ("sweep", "--model", "llama-3.1-8b", "--box", "dgx-spark,rtx-4090", "--boxes", "1-4")
    js = json.loads(run_cli(*args, "--json").stdout)
    text = run_cli(*args, "--csv").stdout
    lines = text.strip().splitlines()
    assert lines[0].startswith("model,box,boxes,link,tp,ep,pp")
    assert len(lines) == len(js) + 1
    assert text == to_csv(js)


def test_constraint_nothing_meets_names_binding_constraint_and_nearest():
    res = run_cli("sweep", "--model", "kimi-k3", "--box", "dgx-spark", "--budget", "20000")
    assert res.returncode == 2
    line = res.stderr.strip()
    assert "\n" not in line
    assert "--budget 20,000 binds" in line and "nearest: kimi-k3" in line and "over --budget" in line
    res = run_cli("sweep", "--model", "llama-3.1-8b", "--min-tok-per-s", "100000")
    assert res.returncode == 2
    assert "--min-tok-per-s 100000 binds" in res.stderr and "under --min-tok-per-s" in res.stderr
    res = run_cli("sweep", "--model", "kimi-k3", "--box", "dgx-spark", "--max-boxes", "4")
    assert res.returncode == 2
    assert "memory" in res.stderr and "GB short of memory" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (("--boxes", "four"), "--boxes 'four'"),
    (("--box", "dgx-sparkle"), "unknown box 'dgx-sparkle'"),
    (("--quant", "fp7"), "fp7"),
    (("--budget", "-5"), "--budget must be > 0"),
    (("--json", "--csv"), "pick one"),
    (("--draft-model", "llama-3.1-8b"), "--draft-model needs --spec-tokens k"),
    (("--model", "llama-3.1-8b,qwen3-30b-a3b", "--spec-tokens", "3", "--draft-model", "llama-3.1-8b"),
     "but qwen3-30b-a3b has 151,936"),
])
def test_bad_input_is_one_line(args, needle):
    res = run_cli("sweep", "--model", "llama-3.1-8b", *args)
    assert res.returncode == 2
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_parse_counts():
    assert parse_counts("4,8-10", None) == (4, 8, 9, 10)
    assert parse_counts(None, 3) == (1, 2, 3)
    with pytest.raises(ShardwiseError, match="--max-boxes 4"):
        parse_counts("8", 4)
