"""The oracle ceiling (bench/oracle.py, bench/oracle_report.py): its dynamic programme finds a
hand-worked optimum, and on tiny models no method's traced decode, priced with the same cost
table, beats it. fp32 on the CPU."""

from pathlib import Path

import pytest
from helpers import PROMPTS, decoder

from specdecode import SamplingParams
from specdecode.bench.oracle import CostTable, Proposals, best_schedule, max_trace_rows, price_trace, turn_proposals
from specdecode.bench.oracle_report import check_oracle_config
from specdecode.drafters.suffix_cache import SuffixCache
from specdecode.engine.trace import PassEvent, PassTrace
from specdecode.errors import InvalidRequestError


def test_the_schedule_is_the_hand_worked_optimum() -> None:
    """Ten tokens, y[0] from prefill; a verify row costs 0.5 of a one-row pass, a draft pass 0.3.
    At position 1 the draft model's 4 tokens are all accepted (a 5-row pass and 4 draft passes:
    3.0 + 1.2 = 4.2 for 5 tokens); at 6 prompt lookup's run of 3 (a 4-row pass, 2.5, for 4
    tokens) lands on 10, the end. Plain decoding costs 9; the oracle 6.7 (taking lookup's single
    token at 2 as well would cost 7.0)."""
    costs = CostTable(verify=(1.0, 1.5, 2.0, 2.5, 3.0), draft_pass=0.3)
    n = 10
    proposals = Proposals(n, {
        "draft": [[min(k, 4 if i == 1 else 0) for k in range(1, 5)] for i in range(n)],
        "ngram": [[min(k, 3 if i == 6 else 1 if i == 2 else 0) for k in range(1, 5)] for i in range(n)],
    })
    seconds, steps = best_schedule(proposals, costs)
    assert seconds == pytest.approx(6.7)
    # y[0] comes with the prompt's pass (free); then the two drafts.
    assert [(s.position, s.source, s.k, s.accepted) for s in steps] == [(0, "none", 0, 0), (1, "draft", 4, 4),
                                                                        (6, "ngram", 3, 3)]
    plain, plain_steps = best_schedule(Proposals(n, {}), costs)
    assert plain == pytest.approx(9.0) and {s.source for s in plain_steps} == {"none"}


def test_dearer_drafts_fall_back_to_plain_decoding() -> None:
    """Where a verify row costs as much as a pass, no accepted run pays for itself: plain."""
    costs = CostTable(verify=(1.0, 2.0, 3.0, 4.0), draft_pass=0.5)
    proposals = Proposals(6, {"draft": [[min(k, 2) for k in range(1, 4)] for _ in range(6)]})
    seconds, steps = best_schedule(proposals, costs)
    assert seconds == pytest.approx(5.0) and all(s.source == "none" for s in steps)


def test_price_trace_leaves_out_prefill_and_prices_every_later_pass() -> None:
    costs = CostTable(verify=(1.0, 1.5, 2.0), draft_pass=0.25, draft_token=0.01)
    trace = PassTrace([
        PassEvent("target", "begin", (64, 0)),
        PassEvent("target", "extend", (0, 30, 0)),  # a prompt chunk without logits
        PassEvent("target", "extend", (30, 10, 1)),  # its last chunk: still prefill
        PassEvent("draft", "extend", (0, 40, 1)),  # the draft's catch-up: 40 x 0.01
        PassEvent("draft", "extend", (40, 1, 1)),
        PassEvent("target", "extend", (40, 3, 3)),  # a verify of 2 drafts
        PassEvent("target", "commit", (42,)),
        PassEvent("target", "tree", (42, 3, 0, 0)),  # a 3-node tree
        PassEvent("target", "extend", (44, 1, 1)),
    ])
    assert price_trace(trace, costs) == pytest.approx(0.4 + 0.25 + 2.0 + 2.0 + 1.0)
    assert max_trace_rows([trace]) == 3
    merged = PassTrace([
        PassEvent("target", "begin", (64, 0)),
        PassEvent("target", "extend", (0, 42, 3)),  # the prompt's 40 tokens and 2 drafts, 3 logit rows
        PassEvent("target", "commit", (41,)),
        PassEvent("target", "extend", (41, 1, 1)),
    ])
    # y[0]'s row is the prompt's: that pass costs its 2 draft rows (2.0 - 1.0), then a plain pass.
    assert price_trace(merged, costs) == pytest.approx(1.0 + 1.0)
    assert max_trace_rows([merged]) == 3  # the prompt's tail is no verify row
    assert costs.target(5) == pytest.approx(3.0)  # past the table: along the last slope
    batch = PassTrace([  # the batch engine holding one request, on torch
        PassEvent("target", "begin", (64, 0)),
        PassEvent("target", "extend", (0, 40, 0)),  # the prompt but its last token: a prefill pass of its own
        PassEvent("target", "commit", (40,)),
        PassEvent("target", "extend", (40, 3, 3)),  # the last prompt token and 2 lookup drafts: y[0]'s pass
        PassEvent("target", "commit", (42,)),
        PassEvent("draft", "begin", (43, 0)),
        PassEvent("draft", "extend", (0, 41, 0)),  # the draft model's read-ahead of its backlog: 41 x 0.01
        PassEvent("draft", "commit", (41,)),
        PassEvent("draft", "extend", (41, 1, 1)),
        PassEvent("target", "extend", (42, 2, 2)),
    ])
    assert price_trace(batch, costs) == pytest.approx((2.0 - 1.0) + 0.41 + 0.25 + 1.5)
    assert max_trace_rows([batch]) == 3


METHODS = (("none", None), ("draft", 3), ("draft", "auto"), ("ngram", 4), ("ngram", "auto"), ("suffix", 4),
           ("suffix", "auto"), ("auto", "auto"))


def test_no_method_beats_the_oracle(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """Every method's traced decode (suffix's token trees included), priced with the decoder's
    own table, costs at least the oracle's schedule, and plain decoding costs exactly what the
    oracle's all-plain schedule does; a multi-turn conversation's second turn drafts from the
    first answer through the suffix cache, as the methods do."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=32)
    turns = [dec.encode(PROMPTS[0] + " " + PROMPTS[0]), dec.encode(PROMPTS[1] + " " + PROMPTS[0])]
    traced: dict[tuple[str, object], list[PassTrace]] = {}
    outputs: dict[tuple[str, object], list[list[int]]] = {}
    for method, k in METHODS:
        dec.suffix_cache.clear()
        dec.forget_prefix()
        for ids in turns:
            with dec.trace_passes() as trace:
                out = dec.generate(ids, params, method=method, k=k).token_ids
            traced.setdefault((method, k), []).append(trace)
            outputs.setdefault((method, k), []).append(out)
    plain = outputs["none", None]
    assert all(out == plain for out in outputs.values())  # fp32 tiny models: greedy is exact
    costs = CostTable.of(dec, max(33, max_trace_rows([t for ts in traced.values() for t in ts])))
    cache = SuffixCache()
    oracle = 0.0
    sources = set()
    for ids, y in zip(turns, plain):
        proposals = turn_proposals(dec, ids, y, cache, suffix_trees=dec.backend == "torch")
        seconds, steps = best_schedule(proposals, costs)
        oracle += seconds
        sources |= {s.source for s in steps}
    assert price_trace(traced["none", None][0], costs) + price_trace(traced["none", None][1], costs) == pytest.approx(
        costs.target(1) * (len(plain[0]) - 1 + len(plain[1]) - 1))
    # The batch engine holding one request (the default) prefills a torch prompt in a pass of its
    # own, without logits (priced as prefill); y[0] then comes from a one-row pass, priced free.
    extends = [e.args for e in traced["none", None][0].events if e.role == "target" and e.op == "extend"]
    assert extends[:2] == [(0, len(turns[0]) - 1, 0), (len(turns[0]) - 1, 1, 1)]
    for key, traces in traced.items():
        priced = sum(price_trace(t, costs) for t in traces)
        assert oracle <= priced * (1 + 1e-9), (key, oracle, priced)
    assert sources - {"none"}, "the repeated prompts give the oracle drafts worth taking"


def test_the_oracle_needs_greedy_decoding_and_plain_decoding_in_the_run() -> None:
    with pytest.raises(InvalidRequestError, match="greedy"):
        check_oracle_config(("none", "auto"), greedy=False, plain_methods=("none",))
    with pytest.raises(InvalidRequestError, match="plain decoding"):
        check_oracle_config(("auto",), greedy=True, plain_methods=("none",))
    check_oracle_config(("none", "auto"), greedy=True, plain_methods=("none",))


def test_bench_oracle_reports_the_ceiling_and_each_methods_share(
    capsys, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, tmp_path: Path
) -> None:
    """``specdecode bench --oracle`` on tiny models: per prompt and category the ceiling (at
    least 1: plain decoding is one of the oracle's schedules) and each method's share of it (at
    most 1), report.md's table, and a traces.json that loads with the models' shapes; refused
    without plain decoding or with sampling."""
    import json

    from specdecode import cli
    from specdecode.engine.trace import load_traces

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question_id": 1, "category": "writing", "turns": [PROMPTS[0] + " " + PROMPTS[0], "Again, please."]},
        {"question_id": 2, "category": "qa", "turns": [PROMPTS[1] + " " + PROMPTS[1]]},
    ]))
    out = tmp_path / "o"
    base = ["bench", "--target", str(tiny_qwen2_dir), "--draft", str(tiny_close_draft_dir), "--dtype", "fp32",
            "--device", "cpu", "--max-new-tokens", "16", "--bandwidth-probe-mib", "0", "--no-warmup",
            "--prompts", str(prompts), "--max-prompts-per-category", "5", "--out", str(out), "--no-plots", "--quiet"]
    assert cli.main(base + ["--methods", "none,draft:3,ngram:auto,auto,hf", "--oracle"]) == 0
    results = json.loads((out / "results.json").read_text())
    group = results["oracle"]["none"]
    assert group["methods"] == ["none", "draft:3", "ngram:auto", "auto"]  # the peers have no trace
    assert [p["prompt_id"] for p in group["prompts"]] == [p["prompt_id"] for p in results["prompts"]]
    for row in group["prompts"]:
        assert row["ceiling"] >= 1.0 - 1e-9 and row["oracle_seconds"] > 0
        for method, figures in row["methods"].items():
            assert figures["equal_to_plain"], method  # fp32: greedy outputs are exact
            assert figures["share"] <= 1.0 + 1e-9, (method, row)
    assert set(group["categories"]) == {p["category"] for p in results["prompts"]} | {"all"}
    assert group["categories"]["all"]["methods"]["none"]["share"] == pytest.approx(
        1 / group["categories"]["all"]["ceiling"])
    assert "Oracle ceiling against none" in (out / "report.md").read_text()
    # --from-results recomputes the shares and categories from the stored rows, to the same figures.
    assert cli.main(["bench", "--from-results", str(out / "results.json"), "--out", str(tmp_path / "re"), "--no-plots",
                     "--quiet"]) == 0
    again = json.loads((tmp_path / "re" / "results.json").read_text())["oracle"]["none"]
    assert again["categories"] == group["categories"] and again["prompts"] == group["prompts"]
    header, traces = load_traces(out / "traces.json")
    assert header["target"]["num_layers"] > 0 and header["draft"] is not None
    assert {t.meta["method"] for t in traces} == {"none", "draft:3", "ngram:auto", "auto"}
    assert len(traces) == 4 * 3  # a trace per method and turn
    capsys.readouterr()
    assert cli.main(base + ["--methods", "draft", "--oracle"]) == cli.EXIT_USER_ERROR
    assert "plain decoding" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "none,draft", "--oracle", "--temperature", "0.7"]) == cli.EXIT_USER_ERROR
    assert "greedy" in capsys.readouterr().err


def test_bench_oracle_on_llamacpp_prices_with_its_own_costs(tiny_ggufs: dict[str, Path], tmp_path: Path) -> None:
    """On the llama.cpp backend the group is none@llama.cpp, its cost table the llama.cpp
    decoder's, suffix drafts are chains, and the torch side gets its own group."""
    pytest.importorskip("llama_cpp")
    from specdecode.bench.runner import Bench, BenchConfig
    from specdecode.prompt_sets import load_prompts, select_prompts

    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS[0] + " " + PROMPTS[0] + "\n")
    methods = ("none", "none@llama.cpp", "draft@llama.cpp", "auto@llama.cpp")
    config = BenchConfig(target=str(tiny_ggufs["target"]), draft=str(tiny_ggufs["close"]), methods=methods,
                         prompts=(str(prompts),), max_new_tokens=16, k=3, dtype="fp32", device="cpu",
                         bandwidth_probe_bytes=0, quiet=True, warmup=False, oracle=True)
    bench = Bench(config)
    results = bench.run(select_prompts(load_prompts(config.prompts), None, None))
    assert set(results["oracle"]) == {"none", "none@llama.cpp"}
    group = results["oracle"]["none@llama.cpp"]
    assert group["methods"] == ["none@llama.cpp", "draft@llama.cpp", "auto@llama.cpp"]
    assert group["cost_table"]["verify_seconds"] != results["oracle"]["none"]["cost_table"]["verify_seconds"]
    (row,) = group["prompts"]
    assert row["ceiling"] >= 1.0 - 1e-9
    for method, figures in row["methods"].items():
        if figures["equal_to_plain"]:  # llama.cpp's multi-row passes may round a near-tie the other way
            assert figures["share"] <= 1.0 + 1e-9, method
