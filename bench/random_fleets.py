"""The default policy against SGLang's rule on randomly drawn fleets and traffic, in the
fleet simulator (virtual time, the production policy and index code).

The study's tables (``bench/work_aware.py``) and the extra shapes
(``bench/work_aware_shapes.py``) are fixed cases someone chose. Here each case is drawn
from ``--seed`` (case ``i`` from the generator seeded ``[seed, i]``, so any case is
re-run alone with ``--cases i``):

* the fleet: 2, 4, 8 or 16 workers; with probability 0.4 a quarter of them (at least
  one) prefill at 0.3-0.7x the others' speed; with probability 0.25 a quarter of them
  (at least one) run 16 requests at once instead of 32; each worker's KV cache holds the
  simulator's default 200,000 tokens, or with probability 0.3 a quarter of that;
* the traffic, one of five families with its sizes drawn (about 700-900 requests):
  shared system prompts (GSP, uniform or Zipf groups), RAG over Zipf documents, multi-turn
  chat (log-normal lengths), unique short prompts mixed with long shared prefixes, and
  llm-d's long prefixes; output lengths fixed or log-normal;
* the arrivals: Poisson, or with probability 0.3 in bursts and lulls
  (``work_aware_shapes.bursty_at_rate``).

For each case SGLang's rule's capacity at the SLO (TTFT p90 <= ``--slo``) is found by the
same bounded sweep as the study's (``work_aware.capacity``), then every policy runs at
each of ``--loads`` fractions of it on one arrival draw. Printed: one line per case and
load (TTFT p50 / p90 / p99 and mean of each policy over the rule's, hit-rate
difference), then per policy and load the geometric mean of the ratios over the cases,
how many cases are worse or better than the rule by more than 5% and 10%, and the worst
cases. ``--json PATH`` writes every row; ``--summarize`` prints the summary of rows
written before (several files merged). ``--learn-at-polls``: capacities learned only at
the router's engine polls, as ``serve`` learns them, not the moment a worker queues.
``--capacity-reported``: every engine tells its capacity from the start, as SGLang's
``/get_server_info`` does (``serve`` reads it; vLLM's must be learned).
``--causal-turns``: the chat cases alone, each turn sent no sooner than the answer
before it has ended (the open-loop draw can put many turns of one conversation in
flight at once, which no chat client does).

    python bench/random_fleets.py                          # cases 0-59, as the study
    python bench/random_fleets.py --cases 7 --loads 0.8     # one case again
    python bench/random_fleets.py --cases 0-29 --json a.json &  # on two cores
    python bench/random_fleets.py --cases 30-59 --json b.json; wait
    python bench/random_fleets.py --summarize a.json b.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import work_aware
import work_aware_shapes
from kvroute.sim import workloads as wl
from kvroute.sim.cost import DEFAULT_CAPACITY_TOKENS, CostModel
from kvroute.sim.fleet import FleetConfig, Prepared, prepare
from work_aware import BASELINE, POLICIES, at_rate, capacity, run

Arrive = Callable[..., Prepared]


@dataclass
class Case:
    index: int
    text: str
    cfg: FleetConfig
    requests: list[wl.Request]
    arrive: Arrive
    conversations: bool = False  # the chat family: each group is one conversation


def _lognormal_outputs(rng: np.random.Generator, reqs: list[wl.Request], median: int) -> str:
    """Output lengths log-normal around ``median`` (shape 0.5-1.2), or left fixed."""
    if rng.random() < 0.5:
        return f"output {median}"
    shape = float(rng.uniform(0.5, 1.2))
    for r in reqs:
        r.output_len = int(min(8 * median, max(4, rng.lognormal(math.log(median), shape))))
    return f"output log-normal({median}, {shape:.1f})"


def _traffic(rng: np.random.Generator, seed: int) -> tuple[str, str, list[wl.Request]]:
    """(family, description, requests) of one case's traffic."""
    family = str(rng.choice(["gsp", "rag", "chat", "mixed", "llmd"]))
    out = int(rng.choice([64, 150, 400]))
    if family == "gsp":
        groups = int(rng.choice([8, 32, 128]))
        system = int(rng.choice([1000, 2000, 6000]))
        question = int(rng.choice([64, 256, 1000]))
        zipf = rng.random() < 0.5
        reqs = wl.gsp(
            groups,
            max(1, 800 // groups),
            system,
            question,
            out,
            popularity="zipf" if zipf else "uniform",
            seed=seed,
        )
        text = f"gsp {groups} groups{' zipf' if zipf else ''}, {system}+{question} tokens"
    elif family == "rag":
        docs = int(rng.choice([50, 200, 800]))
        doc_len = int(rng.choice([1500, 3000, 8000]))
        s = float(rng.uniform(0.6, 1.2))
        reqs = wl.rag(docs, 800, 1000, doc_len, 80, out, zipf_s=s, seed=seed)
        text = f"rag {docs} docs of ~{doc_len} tokens, zipf {s:.1f}"
    elif family == "chat":
        convs = int(rng.choice([16, 64, 160]))
        turns = max(2, 900 // convs)
        system = int(rng.choice([500, 2000]))
        user = int(rng.choice([100, 400]))
        sigma = float(rng.uniform(0.0, 1.2))
        reqs = wl.multiturn(convs, turns, system, user, out, sigma=sigma, seed=seed)
        text = f"chat {convs} x {turns} turns, {system}/{user} tokens, sigma {sigma:.1f}"
    elif family == "mixed":
        share = float(rng.uniform(0.2, 0.8))
        n_prefix = int(rng.choice([4, 12, 48]))
        prefix = int(rng.choice([2000, 6000]))
        g = np.random.default_rng([seed, 21])
        systems = [wl._draw(g, prefix) for _ in range(n_prefix)]
        reqs = []
        for _ in range(900):
            if g.random() < share:
                k = int(g.integers(n_prefix))
                prompt = np.concatenate((systems[k], wl._draw(g, 200)))
                reqs.append(wl.Request(0.0, prompt, out, k))
            else:
                reqs.append(wl.Request(0.0, wl._draw(g, int(g.integers(200, 1500))), out, -1))
        text = f"mixed {share:.0%} on {n_prefix} prefixes of {prefix}, rest unique"
    else:
        groups = int(rng.choice([60, 150]))
        reqs = wl.llmd(groups, max(2, 750 // groups), 6000, 1200, out, seed=seed)
        text = f"llm-d {groups} groups"
    return family, f"{text}; {_lognormal_outputs(rng, reqs, out)}", reqs


def draw(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed`` (see the module doc for the distribution)."""
    rng = np.random.default_rng([seed, index])
    workers = int(rng.choice([2, 4, 8, 16]))
    quarter = max(1, workers // 4)
    base = CostModel()
    speeds = [1.0] * workers
    batches = [base.max_batch] * workers
    parts = [f"{workers} workers"]
    if rng.random() < 0.4:
        f = float(rng.uniform(0.3, 0.7))
        speeds[-quarter:] = [f] * quarter
        parts.append(f"{quarter} at {f:.2f}x prefill")
    if rng.random() < 0.25:
        batches[:quarter] = [16] * quarter
        parts.append(f"{quarter} with 16 slots")
    cache = DEFAULT_CAPACITY_TOKENS
    if rng.random() < 0.3:
        cache //= 4
        parts.append(f"{cache} cached tokens each")
    costs = tuple(
        replace(base, prefill_tokens_per_s=base.prefill_tokens_per_s * s, max_batch=b)
        for s, b in zip(speeds, batches, strict=True)
    )
    bursty = rng.random() < 0.3
    family, traffic, reqs = _traffic(rng, seed * 1000 + index)
    cfg = FleetConfig(
        workers=workers,
        worker_costs=costs,
        capacity_tokens=cache,
        learn_capacity=True,
        policy_settings={"seed": 0},
    )
    arrive = work_aware_shapes.bursty_at_rate if bursty else at_rate
    text = f"{', '.join(parts)}; {traffic}; {'bursty' if bursty else 'poisson'}"
    return Case(index, text, cfg, reqs, arrive, conversations=family == "chat")


def rule_capacity(case: Case, sweep: argparse.Namespace) -> tuple[Prepared, float]:
    """``case``'s requests prepared, and SGLang's rule's capacity at the SLO on them (the
    study's bounded sweep, ``work_aware.capacity``, arrivals drawn as the case draws
    them); ``sweep``: ``slo``, ``max_steps``, ``bisect``."""
    prep = prepare(case.requests, case.cfg.block_size)
    tps = sum(c.prefill_tokens_per_s for c in case.cfg.costs())
    r0 = tps / (prep.prompt_tokens / len(prep.requests)) / 4
    _, pol, st = next(p for p in POLICIES if p[0] == BASELINE)
    work_aware.at_rate = case.arrive  # the sweep draws arrivals as the case does
    try:
        cap, _ = capacity(prep, pol, st, case.cfg, sweep, r0)
    finally:
        work_aware.at_rate = at_rate
    return prep, cap


def _cases(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="the draw of cases")
    ap.add_argument("--cases", default="0-59", help="case indices: 0-59, or 3,7,12")
    ap.add_argument("--loads", default="0.5,0.8,1.0", help="fractions of the rule's capacity")
    ap.add_argument("--policies", default="cache_aware (work),round_robin", help="besides the rule")
    ap.add_argument("--slo", type=float, default=2.0)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--bisect", type=int, default=4)
    ap.add_argument(
        "--learn-at-polls",
        action="store_true",
        help="capacities learned only at the router's engine polls, as serve learns them",
    )
    ap.add_argument(
        "--capacity-reported",
        action="store_true",
        help="every engine tells its capacity from the start, as SGLang's /get_server_info "
        "does and serve reads it (vLLM's are learned)",
    )
    ap.add_argument(
        "--causal-turns",
        action="store_true",
        help="chat cases only (the others are skipped): a conversation's turn is sent at "
        "its drawn time or once the answer before it has ended, whichever is later, as a "
        "chat client sends it (FleetConfig.causal_turns)",
    )
    ap.add_argument(
        "--no-kv-admission",
        dest="kv_admission",
        action="store_false",
        help="workers start a request whenever a decode slot is free, even if its prompt "
        "does not fit in the KV cache beside the running ones (the simulator's model "
        "before FleetConfig.kv_admission)",
    )
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        default=None,
        help="only summarize rows written by --json (several runs' files are merged)",
    )
    a = ap.parse_args()
    if a.summarize:
        saved: list[dict[str, Any]] = []
        for path in a.summarize:
            with open(path) as f:
                saved.extend(json.load(f))
        labels = [k for k in saved[0] if isinstance(saved[0][k], dict) and k != BASELINE]
        summarize(saved, labels, sorted({r["load"] for r in saved}))
        return 0
    chosen = [p for p in POLICIES if p[0] in a.policies.split(",") or p[0] == BASELINE]
    others = [p[0] for p in chosen if p[0] != BASELINE]
    loads = [float(x) for x in a.loads.split(",")]
    sweep = argparse.Namespace(slo=a.slo, max_steps=a.max_steps, bisect=a.bisect)
    rows: list[dict[str, Any]] = []
    print(
        "| case | load | rule p50 / p90 / p99 / mean (s), hit | "
        + " | ".join(f"{o}: x rule p50 / p90 / p99 / mean, hit ±" for o in others)
        + " |\n|---|---|---|"
        + "---|" * len(others),
        flush=True,
    )
    for i in _cases(a.cases):
        case = draw(a.seed, i)
        if a.learn_at_polls:
            case.cfg = replace(case.cfg, learn_at_polls=True)
        if a.capacity_reported:
            case.cfg = replace(case.cfg, capacity_reported=True)
        if not a.kv_admission:
            case.cfg = replace(case.cfg, kv_admission=False)
        if a.causal_turns:
            if not case.conversations:
                continue
            case.cfg = replace(case.cfg, causal_turns=True)
        prep, cap = rule_capacity(case, sweep)
        if cap <= 0.0:
            # Even the sweep's lowest rate misses the SLO under the rule: no load to scale.
            print(f"| {i}: {case.text}; no rate meets the SLO under the rule: skipped | | | |")
            continue
        print(f"| {i}: {case.text}; rule's capacity {cap:.2f} req/s | | | |", flush=True)
        for load in loads:
            p = case.arrive(prep, load * cap, 1)
            got: dict[str, dict[str, float]] = {}
            for label, policy, settings in chosen:
                r = run(p, policy, settings, case.cfg, record=True)
                t = np.asarray(r.extra["ttft"], dtype=np.float64)
                got[label] = {
                    "p50": r.ttft_p50,
                    "p90": r.ttft_p90,
                    "p99": r.ttft_p99,
                    "mean": float(t.mean()),
                    "hit": r.hit_rate,
                }
            rule = got[BASELINE]
            cells = []
            for o in others:
                g = got[o]
                q = "/".join(f"{g[k] / rule[k]:.2f}" for k in ("p50", "p90", "p99", "mean"))
                cells.append(f"{q}, {100 * (g['hit'] - rule['hit']):+.1f}")
            print(
                f"| {i} | {load:g} | {rule['p50']:.2f} / {rule['p90']:.2f} / {rule['p99']:.2f}"
                f" / {rule['mean']:.2f}, {rule['hit']:.1%} | " + " | ".join(cells) + " |",
                flush=True,
            )
            rows.append({"case": i, "text": case.text, "load": load, "capacity": cap, **got})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    summarize(rows, others, loads)
    return 0


def summarize(rows: list[dict[str, Any]], others: list[str], loads: list[float]) -> None:
    """Per policy and load: geometric means of the ratios to the rule, counts of cases
    worse / better by > 5% and > 10%, and the worst cases by p50 and by p99."""
    for o in others:
        print(
            f"\n### {o} over SGLang's rule\n\n| load | cases | geo-mean x rule p50 / p90 / "
            "p99 / mean | worse by >5% / >10%: p50, p90, p99, mean | better by >5% | mean "
            "hit ± (points) |\n|---|---|---|---|---|---|"
        )
        for load in loads:
            sel = [r for r in rows if r["load"] == load]
            if not sel:
                continue
            q = {
                k: np.array([r[o][k] / r[BASELINE][k] for r in sel])
                for k in ("p50", "p90", "p99", "mean")
            }
            geo = " / ".join(f"{float(np.exp(np.log(v).mean())):.2f}" for v in q.values())
            worse = ", ".join(
                f"{int((v > 1.05).sum())}/{int((v > 1.10).sum())}" for v in q.values()
            )
            better = ", ".join(str(int((v < 0.95).sum())) for v in q.values())
            hit = np.mean([100 * (r[o]["hit"] - r[BASELINE]["hit"]) for r in sel])
            print(f"| {load:g} | {len(sel)} | {geo} | {worse} | {better} | {hit:+.1f} |")
        for k in ("p50", "p99"):
            worst = sorted(rows, key=lambda r: -r[o][k] / r[BASELINE][k])[:5]
            print(f"\nWorst by {k}:")
            for r in worst:
                print(
                    f"- case {r['case']} at {r['load']:g}: {r[o][k] / r[BASELINE][k]:.2f}x "
                    f"({r[o][k]:.3f} against {r[BASELINE][k]:.3f} s): {r['text']}"
                )


if __name__ == "__main__":
    raise SystemExit(main())
