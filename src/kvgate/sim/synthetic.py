"""Synthetic workloads with known prefix-sharing structure.

Each generator takes an :class:`Rng` and ``arrivals`` (an :class:`Arrivals` process, or
a number read as a Poisson rate; for sessions and tasks it is the rate at which they
*start*) and returns a :class:`Workload` whose block ids come from the content model of
:mod:`kvgate.sim.synthetic_blocks` (equal token content => equal ids). Lengths drawn
from ``(lo, hi)`` ranges are uniform integers, both ends included. Requests carry the
default tenant and priority; apply classes with
:func:`kvgate.sim.workload.assign_classes` (``session`` is set for chats and agent tasks
so a session keeps one tenant). All are open loop: arrival times do not depend on how
fast a system answers.

Defaults and their sources (research/workloads.md section 4 unless stated):

* :func:`shared_prefix_groups`: SGLang ``bench_serving --dataset-name
  generated-shared-prefix`` (``--gsp-num-groups`` 64, ``--gsp-prompts-per-group`` 16,
  ``--gsp-system-prompt-len`` 2048, ``--gsp-question-len`` 128, ``--gsp-output-len``
  256, ``--gsp-range-ratio`` 1.0, ``--gsp-ordered`` off). The arrival rate is ours
  (SGLang defaults to an infinite rate).
* :func:`multi_turn_chat`, :func:`agent_loops`: kvgate defaults from the simulator
  design (shared 1 024-token system prompt, 3-8 turns, 10 s think time; 4 agent types
  with 6 000-token tool prefixes, 5-20 steps 1-3 s apart), shaped like SGLang's
  ``--gsp-num-turns``, inference-perf ``enable_multi_turn_chat`` and the Mooncake
  tool&agent trace (mean output 182 tokens, research/workloads.md section 1.1).
* :func:`zipf_prefixes`: Zipf(1.1) popularity as in Preble's ablation (tool use,
  research/workloads.md section 2), 300 prefixes as in Preble's ``e2e_toolbench_config``;
  2k-16k-token documents (long-document QA).
"""

from __future__ import annotations

from kvgate.core.rng import Rng, pick_index
from kvgate.sim.synthetic_arrivals import Arrivals, as_arrivals, bursty, constant, poisson
from kvgate.sim.synthetic_blocks import Draft, Segment, build_workload, segment_key
from kvgate.sim.synthetic_random import exponential, shuffle, uniform, uniform_int, zipf
from kvgate.sim.workload_types import Workload

__all__ = [
    "Arrivals",
    "agent_loops",
    "bursty",
    "constant",
    "multi_turn_chat",
    "poisson",
    "shared_prefix_groups",
    "zipf_prefixes",
]

Range = tuple[int, int]


def _span(rng: Rng, r: Range) -> int:
    return uniform_int(rng, r[0], r[1])


def _ratio_len(rng: Rng, length: int, range_ratio: float) -> int:
    """SGLang's ``randint(int(length * range_ratio), length)``; exact when ratio is 1."""
    if range_ratio >= 1.0:
        return length
    return uniform_int(rng, int(length * range_ratio), length)


def shared_prefix_groups(
    *,
    rng: Rng,
    arrivals: Arrivals | float = 16.0,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    range_ratio: float = 1.0,
    ordered: bool = False,
    block_tokens: int = 512,
    name: str = "gsp",
) -> Workload:
    """SGLang's generated-shared-prefix: ``num_groups`` system prompts, each followed by
    ``prompts_per_group`` unique questions. Requests of all groups are shuffled
    (``ordered=True``: group after group, SGLang's ``--gsp-ordered``); then they take
    the arrival times in that order. Lengths below 1.0 ``range_ratio`` are drawn from
    ``[int(len * ratio), len]`` (system prompt once per group)."""
    if num_groups < 1 or prompts_per_group < 1:
        raise ValueError("need num_groups >= 1 and prompts_per_group >= 1")
    sys_len = [_ratio_len(rng, system_prompt_tokens, range_ratio) for _ in range(num_groups)]
    items: list[tuple[int, int, int, int]] = []  # group, prompt, question len, output len
    for g in range(num_groups):
        for p in range(prompts_per_group):
            q = _ratio_len(rng, question_tokens, range_ratio)
            o = _ratio_len(rng, output_tokens, range_ratio)
            items.append((g, p, q, o))
    if not ordered:
        shuffle(rng, items)
    times = as_arrivals(arrivals).times(len(items), rng)
    drafts = [
        Draft(
            arrival_s=t,
            segments=(
                Segment(segment_key(name, "sys", g), sys_len[g]),
                Segment(segment_key(name, "q", g, p), q),
            ),
            output_tokens=o,
        )
        for (g, p, q, o), t in zip(items, times, strict=True)
    ]
    return build_workload(name, block_tokens, drafts)


def _session_draft(
    t: float,
    context: list[Segment],
    out: int,
    session: str,
    prev: int | None,
    gap: float,
    closed_loop: bool,
) -> Draft:
    """One request of a session planned at ``t``; closed loop, it is sent ``gap`` after
    the answer to draft ``prev`` instead."""
    return Draft(
        arrival_s=t,
        segments=tuple(context),
        output_tokens=out,
        session=session,
        after=prev if closed_loop else None,
        think_s=gap if closed_loop else 0.0,
    )


def multi_turn_chat(
    *,
    rng: Rng,
    arrivals: Arrivals | float = 0.5,
    num_sessions: int = 200,
    turns: Range = (3, 8),
    system_prompt_tokens: int = 1024,
    user_tokens: Range = (100, 300),
    output_tokens: Range = (200, 400),
    think_time_s: float = 10.0,
    block_tokens: int = 512,
    name: str = "chat",
    closed_loop: bool = False,
) -> Workload:
    """Chat sessions sharing one system prompt; ``arrivals`` starts sessions.

    Turn *k* of a session sends system + (user_1, assistant_1, ..., user_k): the
    previous prompt, the previous output and a new user message. So turn *k+1* shares
    every *full* block of turn *k*'s prompt; turn *k*'s partial last block is not shared
    (new tokens fill it). Turn *k+1* arrives an exponential think time (mean
    ``think_time_s``) after turn *k* arrives, or, with ``closed_loop``, that think time
    after turn *k* is answered (the same draws, so the same prompts). Sessions are
    ``"<name>-s<i>"``.
    """
    if num_sessions < 0:
        raise ValueError("num_sessions must be >= 0")
    starts = as_arrivals(arrivals).times(num_sessions, rng)
    system = Segment(segment_key(name, "system"), system_prompt_tokens)
    drafts: list[Draft] = []
    for s, start in enumerate(starts):
        session = f"{name}-s{s}"
        context: list[Segment] = [system]
        t, think, prev = start, 0.0, None
        n_turns = _span(rng, turns)
        for k in range(n_turns):
            context.append(Segment(segment_key(name, s, "user", k), _span(rng, user_tokens)))
            out = _span(rng, output_tokens)
            drafts.append(_session_draft(t, context, out, session, prev, think, closed_loop))
            prev = len(drafts) - 1
            context.append(Segment(segment_key(name, s, "assistant", k), out))
            if k + 1 < n_turns:
                think = exponential(rng, think_time_s)
                t += think
    return build_workload(name, block_tokens, drafts)


def agent_loops(
    *,
    rng: Rng,
    arrivals: Arrivals | float = 0.2,
    num_tasks: int = 100,
    agent_types: int = 4,
    tool_prefix_tokens: int = 6000,
    task_tokens: Range = (200, 800),
    steps: Range = (5, 20),
    step_gap_s: tuple[float, float] = (1.0, 3.0),
    tool_output_tokens: Range = (500, 2000),
    output_tokens: Range = (50, 200),
    block_tokens: int = 512,
    name: str = "agent",
    closed_loop: bool = False,
) -> Workload:
    """Agent/tool loops; ``arrivals`` starts tasks.

    A task picks one of ``agent_types`` (uniformly), whose long tool/system prefix all
    its tasks share, then a task description. Each of its K steps sends the whole
    context and gets a short output (a tool call); the next step, a uniform
    ``step_gap_s`` later, appends that output and the tool's result. Open loop (the
    default), "later" counts from the previous step's arrival, so under load a task
    has several steps in flight at once; with ``closed_loop`` it counts from the
    previous step's answer, as a real agent must wait for it (the same draws, so the
    same prompts). Sessions are ``"<name>-t<i>"``.
    """
    if num_tasks < 0 or agent_types < 1:
        raise ValueError("need num_tasks >= 0 and agent_types >= 1")
    starts = as_arrivals(arrivals).times(num_tasks, rng)
    prefixes = [
        Segment(segment_key(name, "tools", a), tool_prefix_tokens) for a in range(agent_types)
    ]
    drafts: list[Draft] = []
    for i, start in enumerate(starts):
        session = f"{name}-t{i}"
        context = [
            prefixes[pick_index(rng, agent_types)],
            Segment(segment_key(name, i, "task"), _span(rng, task_tokens)),
        ]
        t, gap, prev = start, 0.0, None
        n_steps = _span(rng, steps)
        for k in range(n_steps):
            out = _span(rng, output_tokens)
            drafts.append(_session_draft(t, context, out, session, prev, gap, closed_loop))
            prev = len(drafts) - 1
            if k + 1 < n_steps:
                context.append(Segment(segment_key(name, i, "call", k), out))
                context.append(
                    Segment(segment_key(name, i, "result", k), _span(rng, tool_output_tokens))
                )
                gap = uniform(rng, step_gap_s[0], step_gap_s[1])
                t += gap
    return build_workload(name, block_tokens, drafts)


def zipf_prefixes(
    *,
    rng: Rng,
    arrivals: Arrivals | float = 4.0,
    num_requests: int = 1000,
    num_documents: int = 300,
    zipf_s: float = 1.1,
    document_tokens: Range = (2000, 16000),
    question_tokens: Range = (20, 200),
    output_tokens: Range = (50, 300),
    block_tokens: int = 512,
    name: str = "zipf",
) -> Workload:
    """Each request = one of ``num_documents`` documents (rank *k* chosen with
    probability proportional to ``1 / (k+1) ** zipf_s``) + a unique question. Document
    lengths are drawn once per document."""
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    popularity = zipf(num_documents, zipf_s)
    docs = [
        Segment(segment_key(name, "doc", d), _span(rng, document_tokens))
        for d in range(num_documents)
    ]
    times = as_arrivals(arrivals).times(num_requests, rng)
    drafts = []
    for i, t in enumerate(times):
        doc = docs[popularity.sample(rng)]
        q = Segment(segment_key(name, "q", i), _span(rng, question_tokens))
        out = _span(rng, output_tokens)
        drafts.append(Draft(arrival_s=t, segments=(doc, q), output_tokens=out))
    return build_workload(name, block_tokens, drafts)
