"""kvgate's own policy: cache benefit against load, with a breaker, spread,
exploration and hot-prefix replication.

Theory of operation
-------------------
Two forms of the score, both "cache benefit minus load", chosen by ``form``:

``form="brief"``, the design brief's function::

    bonus   = min(matched_tokens / max_prefix_len, 1) * cache_weight
    penalty = min(queue / max_queue, 1) + util_weight * utilisation
    score   = w_cache * bonus - w_load * penalty          (w_cache : w_load = 3 : 1)

``form="ttft"`` (the default), a predicted time to first token in seconds::

    bonus   = (h / prefill_tokens_per_s + c * h^2 / 2) * cache_weight
              (h = saved tokens: the prefill time of the cached prefix)
    prefill = pending_prefill_tokens / prefill_tokens_per_s      (queued prefill,
            + c * sum(q * (h + q / 2))                            linear and attention)
    penalty = prefill - e        if e <= head                     (the head's progress,
              prefill - 2 * head + e   otherwise                   or its overrun)
            + decode_s * utilisation                             (decode batch)
            + kv_pressure_s * max(0, (utilisation - 0.8) / 0.2)   (preemption risk)
            + decode_s_per_context_token * in-flight context tokens  (the decode
                                                                 batch's contexts)
    score   = cache_gain * bonus - penalty

In both the bonus grows with the prefill actually saved, not with the matched
*fraction*. The brief's form counts requests in the queue and caps both terms;
on real traces (prompts of 1k to 100k tokens) a request count says little about
how long a newcomer waits, so the default counts the prefill tokens this gateway
has sent the node that have not produced a first token yet, and does not cap the
saving. The node works through that queue in send order, one prefill at a time
(vLLM's chunked prefill is first come first served), so of the head, the oldest,
it has done ``e = clock - prefill_since`` (since the send that found the queue
empty, or since the head before it got its first token): a holder half-way
through a long prefill is not scored as if it had not begun (Dynamo's ``aic``
prefill-load model decays the oldest active prefill the same way). A head past
its predicted ``head`` seconds without a first token is larger than predicted (a
hit the index promised was evicted, a preemption): its overrun so far is taken as
what is left of it, so a stalled node grows less attractive by the second instead
of looking idle. ``clock`` is ``now`` in steps of ``DRAIN_TICK_S`` (10 ms), so busy
nodes are rescored at most 100 times a second.

``prefill_tokens_per_s`` (12 000) is below what the simulator's A100-8B profile
prefills alone (about 14 850 tokens/s on the linear term, t0 included): a node's steps
also carry its decodes. Over eight replays of the conversation trace (0.8 / 0.95 of
round robin's saturation, paired) 15 000 put TTFT p99 up by 0.22 / 0.31 s (at 0.8
beyond noise) and TTFT mean by 0.023 / 0.031 s (beyond it at both); 10 000 moved
everything within noise and the hit ratio down 0.0015 / 0.0006.

``cache_gain`` (5) values a hit above its own TTFT saving because it also spares
the node work that later requests would queue behind. ``cache_weight`` drops below
1 while a node has announced a bulk eviction; the request's ``cache_discount`` lowers
it further on the nodes another tenant's flood is confined to.

``decode_s_per_context_token`` (1.74e-5) weighs the prompt tokens of the requests
we have in flight on the node: each decode step attends over all of them (``k`` per
token per step in the timing model), so a newcomer's ~200 decode steps slow by
about ``200 * k`` per in-flight token, 1.74e-5 s on the A100-8B profile. That is
Dynamo's decode-blocks term, except that a prefix shared by several in-flight requests
counts once per request (the attention work each step does), where Dynamo counts
unique blocks (the KV memory they take); on open-loop agent tasks, whose steps overlap,
that makes a long task's holder look far busier than to Dynamo. It keeps
long-context sessions from piling onto their holders (on the simulator's agent
workload the decode batches of a few holders otherwise push requests over the 100 ms
TPOT target). Alone it also moves
conversations off their holders (the conversation trace's hit ratio falls by up to
0.007); the affinity slack below more than wins that back. Twice or four times the
weight (3.5e-5 / 7e-5) put agent's TTFT p99 at 0.95 of saturation up by 0.19 / 2.21 s
(seeds 0-7) and lowered gsp's and agent's hit ratio (agent's at 0.95 by 0.0014 /
0.0195).

The score predicts the first token only. Tried and left out, terms for what comes
after it (over seeds 0-3 at 0.8 / 0.95 of round robin's saturation): the newcomer's
own decode stretched by the prefill the node has been sent lately (``max_tokens`` *
15 ms * r / (1 - r), r the prefill seconds per second sent there over 10 s, weighed
0.5) lifted chat's goodput (kvgate's last request ends later: its session's holder
decodes three other late turns) in 4 of 8 runs against 1, but put the agent
workload's TTFT p99 at 0.95 to 1.12 s from 0.66 s and left its TPOT p99 at 0.10 s
(on the conversation trace, eight replays at 0.8 / 0.95: TTFT mean 1.460 / 1.564 s
against 1.520 / 1.636 s, hit ratio 0.1673 / 0.1628 against 0.1745 / 0.1711);
adding the newcomer's prefill times the requests in flight there (the decodes it
stalls; weighed 0.5 or 1, with the first term or alone) lifted chat's goodput in 2-3
of 8 runs and put agent's TTFT p99 at 0.95 to 0.83-1.57 s; sending a request away
from a node whose r passed 0.35 / 0.45 (the agent workload's TPOT misses all sat on
holders at r 0.23-0.55) put agent's TTFT p99 at 0.8 to 3.16 / 2.03 s from 0.57 s, its
hit ratio to 0.818 / 0.842 from 0.876, and its TPOT p99 at 0.95 to 0.136 / 0.118 s
from 0.098 s, up, not down: a step moved off its holder is a full prefill of a
10k-30k-token context that stalls the decodes where it lands.

Seven more rules of the ttft form (one off by default, one for fleets) look past the
request itself:

* **Blocking cost.** A long uncached prefill (at least ``blocking_min_s`` at the
  winner, e.g. a 12k-token prompt nobody holds) stalls its node's queue while it
  runs, and every request that comes for that node's cache meanwhile either waits
  or is sent away and misses. Such a request is rescored over every candidate with
  ``blocking_cost * its prefill there * the node's cache value rate`` subtracted,
  the rate being the prefill seconds per second our hits on that node have saved
  lately (decayed over ``cache_value_tau_s``). Long prompts land where they block
  the least-used cache; short ones never pay the extra pass. The rule costs long
  prompts some wait (on the conversation trace at 0.8 of saturation, prompts of 32k
  tokens or more that hit nothing start 0.10 s later on average than on the soonest
  node, 47 of them over 0.5 s), and that wait is not what sets TTFT p99 there:
  allowing the rule at most 0.25 / 0.5 / 1 s past the soonest start raised TTFT p99 to
  17.26 / 17.21 / 17.16 s from 17.10 s and TTFT mean to 1.528-1.554 s from 1.520 s
  (eight replays; hit ratio 0.1739-0.1749 against 0.1745). Measured again with the
  short-gain window below, a bound of 1 / 3 s put TTFT mean up by 0.015 / 0.005 s at
  0.8 and 0.018 / 0.000 s at 0.95 (paired; 1 s beyond noise) and moved TTFT p99 by
  +0.04 / +0.17 s and +0.01 / -0.07 s, within noise. A cache value rate decayed
  over 60-300 s instead of 30 s took TTFT mean at 0.8 of saturation down by 0.018-0.026
  s (paired over the eight replays; beyond their noise from 90 s on; at 0.95 0.006-0.017
  s, within it), but TTFT p99 moved by -0.21 to +0.19 s, all within noise, and the
  checks all held in 1-6 of the 16 runs against 6; on the synthetic workloads (seeds
  0-7) 120 s took the hit ratio of agent and gsp down by 0.0003-0.0006 and left chat as
  it was. Nor does the rule's wait set that tail: without the rule for prompts of 16 s
  of predicted prefill or more (paired over the eight replays at 0.8 / 0.95) TTFT mean
  rose by 0.021 / 0.038 s and goodput fell by 0.012 / 0.038 requests/s, beyond noise,
  and TTFT p99 moved +0.02 / +0.22 s, within it. Measured again in this build: in the
  issue's run at 0.8 the slowest 1 % wait 0.83 s on top of their own prefill
  (``ttft_parts``), 0.57 s of it the rule's placements (25 of them on a node with over
  0.5 s more queued than the soonest); sending prompts of 12 s of prefill or more to the
  soonest start left the tail's wait at 0.87 s (requests kept for holders those prompts
  then block took their places) and moved TTFT p99 by +0.07 / -0.12 s (eight replays,
  within noise), TTFT mean by +0.013 / +0.011 s and the hit ratio by -0.0014 / -0.0019.
  Its weight is at an optimum both ways: a ``blocking_cost`` of 2 / 5 (paired over the
  eight replays at 0.8 / 0.95) moved TTFT p99 by +0.15 / -0.09 s and +0.22 / +0.06 s
  and the hit ratio by -0.0013 / -0.0003 and -0.0022 / -0.0011 (at 0.8 beyond noise for
  5); the checks all held in 3 / 3 and 2 / 2 of the eight runs at each point, against
  4 / 3.
* **Affinity slack.** When an open holder would save at least ``affinity_min_gain_s``
  (0.03 s, ~360 tokens on the A100-8B profile) more prefill than the winner and its
  predicted TTFT (penalty plus the request's prefill less what its cache saves, plus
  its blocking cost when the blocking rule rescored the request) is within
  ``affinity_slack_s`` (20 s) of the winner's, the holder that saves the most keeps
  the request (ties: the sooner first token, then the lower slot); a holder above 80 %
  KV utilisation is not held to (a request kept there risks preemptions), nor is one
  past the bounded wait below. Less than a block is not a context worth waiting for,
  and a long prompt placed by the blocking rule is not sent back to a busy cache for a
  sliver of it. The score trades TTFT seconds for saved prefill seconds one request at
  a time; it does not see that sending a request away from its holder copies the
  prefix onto a second node, where it pushes other sessions' caches out, and that the
  next turn of the session then misses wherever the copy is not. On the conversation
  trace (0.8 / 0.95 of round robin's saturation) a slack of 0 gave a hit ratio of
  0.1638 / 0.1586 where 10 s gave 0.1731 / 0.1694 (measured before the bounded wait,
  with a minimum gain of 0.1 s; at 0.1 s a short turn whose holder had one block more
  than the others, the trace's first block being everyone's, left for a node 0.3-2 s
  less busy, and the 1k-4k bucket's hit ratio was 0.2818 against
  sglang_cache_aware's 0.3095).
* **Bounded wait.** No request is kept waiting for its cache more than
  ``max_cache_wait_s`` (20 s) beyond the soonest predicted first token among the
  candidates (penalty less what the node's cache saves; the request's prefill cancels
  out): a winner past it gives way to the soonest node, and the slack keeps no holder
  past it. The score trades a request's seconds for the node work its hit saves, up
  to ``cache_gain`` to one, so without a bound a long context (20k-75k tokens cached)
  stayed 20-30 s with a holder busy with somebody's 100k-token prefill, where a full
  prefill elsewhere took 4-16 s.

  The slack and the bound set where kvgate sits between hit ratio and TTFT tail, and
  only on long-context traces: on the simulator's synthetic workloads no wait comes near
  10 s, and 10 or 20 s give identical results. On the conversation trace each of the ten
  longest such waits we traced was a session whose holder took a fresh 80k-120k-token
  prompt (17-36 s of prefill) 1-25 s before it came back: it waits (and may join the
  slowest 1 %) or moves (and its whole context misses). Averaged over four replays (the
  even spread and ``--bucket jitter`` seeds 1-3) at 0.8 / 0.95 of saturation, a slack
  and a bound of 10 s gave a hit ratio of 0.1708 / 0.1657 at a TTFT p99 of 16.89 / 17.01
  s, and of 20 s 0.1755 / 0.1730 at 17.15 / 17.53 s (TTFT mean 1.42-1.48 / 1.52-1.57 s
  against 1.50-1.53 / 1.60-1.65 s); sglang_cache_aware, which never leaves a holder,
  hits 0.1739 / 0.1703, and dynamo_cost's TTFT p99 is 17.14 / 18.27 s. A slack of 10 s
  under a 20 s bound keeps the hit ratio of 10 s (0.1720 / 0.1661 on the even spread):
  the hits are short and medium turns kept on their holders; 25 s each gives 0.1786 /
  0.1725 at 18.06 / 18.50 s. At 0.6 of saturation (even spread) the longer wait costs
  TTFT mean: 1.417 s with 20 s against 1.360 s with 10 s (dynamo_cost 1.396 s), for a
  hit ratio of 0.1800 against 0.1762.

  Tried and left out: a slack in proportion to what the wait buys (a holder kept only
  within 20 or 40 s of wait per second of extra prefill saved), aimed at the short
  turns the slack keeps 12-16 s behind a busy holder for one block more (0.04 s).
  Over eight replays (even spread, jitter seeds 1-7) at 0.8 / 0.95 of saturation, 20
  took TTFT mean from 1.520 / 1.636 s to 1.440 / 1.553 s and goodput from 2.582 / 2.960
  to 2.601 / 2.981, but the hit ratio from 0.1745 / 0.1711 to 0.1735 / 0.1687
  (sglang_cache_aware 0.1728 / 0.1701): each turn it moves copies its context onto a
  second node, where it evicts other sessions' caches (stale routing was not the
  cause: of the blocks the index predicted, 4 % were gone at submit). On two of four
  agent seeds at 0.95 of saturation it put TTFT p99 up by 0.37 and 1.02 s; 40 left
  the synthetic workloads nearly as they were (means over seeds 0-7 within 0.011 s of
  TTFT p99) and took TTFT mean to 1.467 / 1.576
  s at a hit ratio of 0.1732 / 0.1702, but on the even spread alone the hit ratio
  fell to 0.1724 / 0.1675 (sglang_cache_aware 0.1735 / 0.1706). A minimum
  gain of 0.05 s (past one block) gave TTFT mean 1.499 / 1.611 s at a hit ratio of
  0.1741 / 0.1690.

  **Short gains.** A holder that saves less than ``affinity_short_gain_s`` (0.25 s,
  ~3k tokens on the A100-8B profile) more than the winner keeps the request only
  within ``affinity_short_slack_s`` (4 s) of the winner's predicted TTFT. On the
  conversation trace at 0.8 of round robin's saturation (even spread) kvgate lost
  TTFT mean to dynamo_cost (1.479 against 1.473 s) on prompts under 16k tokens and won
  it on longer ones: 52 prompts under 4k tokens waited 3-16 s for a holder that saved
  them 512-3 072 tokens (0.04-0.25 s), each behind a prompt of 25k-121k tokens
  (median 62k) whose prefill had not finished, where dynamo_cost mostly started
  them in 0.1-0.4 s, and
  125 of 4k-16k tokens waited 3 s or more (42 for dynamo_cost). Moving a short turn
  copies only what its holder had beyond the winner, a few blocks, where the
  proportional slack above also moved 5k-30k-token contexts. Paired over eight
  replays (seeds 0-7) at 0.8 / 0.95: TTFT mean -0.053 / -0.052 s (95 % interval
  -0.067 .. -0.039 / -0.071 .. -0.032), goodput +0.013 / +0.015 requests/s (both
  beyond noise), hit ratio +0.0004 / +0.0002, TTFT p99 -0.08 / -0.04 s (within
  noise); on jitter seeds 8-15, TTFT mean -0.040 / -0.048 s and goodput +0.010 /
  +0.012 (beyond noise), hit ratio -0.0014 / -0.0018 and TTFT p99 -0.02 / +0.04 s
  (within noise). Against the same base (seeds 0-7): a 2 s window, TTFT mean -0.054 /
  -0.058 s but hit ratio -0.0004 / -0.0009; 6 s, TTFT mean -0.039 / -0.039 s; a gain
  of 0.4 s, hit ratio -0.0025 at 0.95 (-0.0041 .. -0.0009, below sglang_cache_aware's
  beyond noise); 0.15 s, TTFT mean -0.039 / -0.031 s (seeds 8-15: -0.027 / -0.032 s)
  at about the same hit ratio. The synthetic
  workloads (seeds 0-7) are unchanged but for agent at 0.95 (TTFT p99 -0.12 s,
  within noise): their waits are shorter. ``affinity_short_gain_s=0`` turns it off.

* **Tail guard.** The cache's pull (``cache_gain``, the slack, the bounded wait) trades
  a request's seconds for prefill its hit saves; it must not make the request one of
  the slowest. The tail level is the ``tail_quantile`` (0.99) of the predicted full
  prefill times (no cache anywhere) of the last ``tail_window`` (1 000) requests this
  policy routed: how long the slowest requests take wherever they go. When the chosen
  node's predicted first token (its queued prefill still to run, plus what this
  request's prefill leaves after its cache there) is past the level and some candidate's
  is not, the best scored of those under the level gets the request (an open holder
  with its bonus, or a non-holder). A prompt that is slow everywhere keeps its choice;
  until a window of requests is seen there is no level. On the conversation trace the
  slowest 1 % are 80k-120k-token prompts (17-33 s of prefill wherever they run), and
  the waits the slack allowed put short and medium turns among them (a 13k-token turn,
  all of it cached, 17.8 s behind its holder's 97k-token prefill while a node sat
  idle; 9 such requests above 17 s at 0.8 of saturation, none for dynamo_cost, whose
  TTFT p99 kvgate then lost by 0.1 s). The guard moves 11-14 requests a run there; it
  trades hit ratio for the tail. Over eight replays (the even spread and ``--bucket
  jitter`` seeds 1-7) at 0.8 / 0.95 of saturation it took kvgate's TTFT p99 from 17.22
  / 17.63 s to 17.09 / 17.40 s (dynamo_cost 17.22 / 18.06 s) and its hit ratio from
  0.1758 / 0.1721 to 0.1746 / 0.1708 (sglang_cache_aware 0.1728 / 0.1701); TTFT mean
  1.52 s either way at 0.8. Run by run, the checks against the other policies held in
  11 of the 16 runs with and without it: it turned TTFT p99 losses into hit-ratio ones.
  On seeds 0-3 (7 of 8 runs held) a level at the 0.985 quantile moved twice as many
  requests and held 6, a window of 400 or 3 000 held 3 and 5, a level from the 200th
  request on 6, a slack and bound of 25 s 4; a ``cache_gain`` of 6 held 8 there but 3
  of seeds 4-7's 8 (5 held 4). On the synthetic workloads (about 1 000 requests each)
  the guard has barely begun when the run ends. The level reads full prefills, so on
  that trace it sits near 22 s while TTFT p99 is 17 s (the slowest prompts often hit),
  and turns predicted at 17-18 s pass under it; a level over the chosen nodes'
  predicted first tokens instead (the delivered TTFT) held the quality bar's checks
  in 5 of 16 runs (eight replays at 0.8 / 0.95) against 6: TTFT p99 17.10 / 17.32 s
  against 17.10 / 17.41 s, hit ratio 0.1751 / 0.1707 against 0.1745 / 0.1711.
  That trade is the frontier the report's split of TTFT shows (``ttft_parts``): in the
  issue's run at 0.8 the slowest 1 % have as much prefill of their own as dynamo_cost's
  (24.97 against 25.01 s) and wait 0.83 s on top of it against 0.12 s. A second level
  at the 0.98 quantile of the chosen nodes' predicted first tokens, a request past it
  going to the best scored candidate under it, took TTFT p99 down by 0.07 / 0.30 s
  (paired over the eight replays at 0.8 / 0.95; within noise) and TTFT mean by 0.011 /
  0.013 s, and the hit ratio down by 0.0038 / 0.0028 (beyond noise): TTFT p99 then beat
  dynamo_cost's in 7 / 8 of the runs, the hit ratio sglang_cache_aware's in 2 / 1, and
  all checks held in 2 / 1 against 4 / 3. At the 0.99 quantile, moving only to
  candidates under half of it: TTFT p99 -0.01 / -0.04 s, hit ratio -0.0005 / -0.0003,
  all checks in 3 / 3.
  The report's split of the wait (``queued_mean_s``, ``slowed_mean_s``) shows the rest
  of that tail: 0.524 s queued (mostly three turns kept 12-26 s behind their holder's long
  prefill) and 0.305 s slowed against dynamo_cost's 0.061 / 0.058 s; traced step by
  step, a third of the slowed seconds are the first chunks of turns sent to the node
  meanwhile, admitted beside the long prompt's last chunk (attention over their long
  cached context: 0.1-0.4 s a step), which dynamo_cost never does to its slowest.
  Tried and left out (paired over the eight replays, mean difference and its standard
  error): a last guard moving a kept turn (a holder, after every rule above) whose
  predicted first token passed a level X to the soonest candidate under X, if it lost at
  most 48k cached tokens: X = 17 s moved TTFT p99 by -0.05 +- 0.06 / -0.26 +- 0.19 s at 0.8
  / 0.95 and the hit ratio by -0.0013 / -0.0022 (0.1686 at 0.95, under
  sglang_cache_aware's 0.1701), all checks holding in 6 / 2 runs against 4 / 3; X = 15
  s, TTFT p99 -0.10 +- 0.05 s at 0.8 for a hit ratio of -0.0020 (4 runs); X at 0.9 of
  the 0.99 quantile of the best predicted first token over the last 4 000 requests (a
  level not fixed to this trace), -0.07 / -0.13 s for -0.0008 / -0.0009 (3 / 2 runs).
  Each such turn moved copies its context to a second node, and the hit ratio has
  almost no room above sglang_cache_aware's at 0.95. Holding new requests out of the
  step that carries a 60k-token or longer uncached prompt's last chunk (the engine
  patched to do so, as a gateway deferring such turns until that first token would)
  moved TTFT p99 at 0.8 by -0.02 +- 0.02 s and left the hit ratio as it was: the
  deferred turns, themselves kept waiting for their holder, took the seconds instead.
  Nor did a blocking cost read from the contexts each node holds rather than from the
  hits it saved (sessions come back 2-8 minutes later, long after a 30 s decay, and a
  113k-token prompt once landed on the holder of a 100k-token session 4 s before it
  returned): per node, the contexts we sent there in the last 150 s, each costing
  min(D / 2, its prefill) x D / 300 s for a prefill of D seconds (the wait or the loss
  it meets if it comes back meanwhile). In place of the hit-saved rate it put TTFT p99
  at 0.8 up by 0.21 +- 0.06 s and the hit ratio down by 0.0022; added to it at 0.3 of
  that weight, -0.03 +- 0.06 s and -0.0003 (all checks 5 runs of 8 against 4).
  Adding a cost for the blocks a long prompt writes, their prefill over the age of the
  node's least recently used block (the index's image of its LRU: what that write would
  evict, 110-190 s old on that trace; at 150 s, 0.5-1 x a block's prefill), cost the hit
  ratio 0.0014-0.0018 and TTFT p99 0.09-0.11 s at 0.8.
  The index's image of a node's LRU is ordered by dispatch, the engine's by release (a
  request's blocks join the free queue when it ends, its prefill and decode later).
  Touching a completed request's chain again in the controller (approximate mode) took
  the index's precision from 0.957 to 0.970 (0.8, seed 0). Against the baselines as they
  are, with the slack at 20 s it took the hit ratio at 0.95 up by 0.0020 +- 0.0008
  (paired over the eight replays) and TTFT p99 at 0.8 up by 0.11 +- 0.04 s (seeing more
  of its holders' caches, the policy kept more turns waiting for them); with the slack
  at 15 s, TTFT p99 -0.09 +- 0.05 / -0.26 +- 0.13 s, TTFT mean -0.016 / -0.022 s, hit
  ratio +0.0002 / +0.0007, all checks in 6 / 8 runs against 4 / 3. But the index serves
  every policy, and with it the baselines' hit ratios rose too, sglang_cache_aware's at
  0.95 from 0.1701 to 0.1738 (dynamo_cost's TTFT p99 at 0.8 17.167 s, preble_e2's hit
  ratio 0.1698 / 0.1706): against them the checks held in 2 / 3 runs with a 20 s slack
  and 3 / 0 with 15 s (the hit ratio at 0.95 in none). It is left out for now, recorded
  for the next change to the index; a slack and bound of 17 s gave 4 / 0 against those
  baselines, the X = 17 s guard 2 / 0. The synthetic workloads, whose caches the index
  never overfills, do not move.
* **TTFT target** (off by default). With ``ttft_target_s`` set (a TTFT SLO, e.g. 5 s)
  the tail guard's level is never above it, and it needs no window: a request whose
  chosen node would start it past the target goes to the best scored node that would
  not, if there is one. The cache's pull keeps a request waiting for its holder as
  long as the wait buys enough saved prefill (the slack and the bounded wait allow 20
  s), which a TTFT SLO does not forgive. On the conversation trace at 0.6 of round
  robin's saturation (even spread), 121 requests hit their cache and still missed a 5
  s TTFT, every one of which a full prefill elsewhere would have started in time
  (dynamo_cost: 15); with a 5 s target, 8. At 0.6 / 0.8 / 0.95 it took TTFT mean from
  1.417 / 1.479 / 1.611 s to 1.343 / 1.406 / 1.480 s and goodput from 1.981 / 2.597 /
  2.958 to 1.997 / 2.618 / 3.020 requests/s, TTFT p99 17.25 / 16.84 / 17.18 s to 17.22
  / 17.06 / 17.02 s, and the hit ratio from 0.1787 / 0.1765 / 0.1706 to 0.1701 / 0.1653
  / 0.1642: each request it moves copies its context onto a second node, and
  sglang_cache_aware (0.1722 / 0.1735 / 0.1706) then hits more. A looser target
  spends less: over eight replays at 0.8 / 0.95, 12 s took TTFT mean to 1.472 / 1.584
  s from 1.520 / 1.636 s and TTFT p99 to 16.94 / 17.12 s from 17.10 / 17.41 s, but
  the hit ratio to 0.1721 / 0.1677 from 0.1745 / 0.1711 (sglang_cache_aware 0.1728 /
  0.1701), and the checks all held in 2 of the 16 runs against 6 (8 s: 1). Off by
  default: it spends cache reuse (node work) on a few requests' first tokens, and
  which counts more is the deployment's call; a gateway held to a TTFT SLO should set
  it to that SLO. On the synthetic workloads no first token comes near 2 s: nothing changes.
  A request may carry a target of its own (``RouteContext.ttft_target_s``; the lower
  one counts): the controller gives every P0 request what is left of the P0 TTFT SLO
  after its wait in the gateway's queue. On the ``p2_flood`` scenario (agent, 0.8 /
  0.95 of saturation) P0 tasks otherwise waited 6-9 s behind P2 prefills on their
  holders, and P0 TTFT p99 reached 7.70 / 7.85 s; with it every seed of 0-3 stays
  within 3.50 s.
* **New-session spread.** A request that starts a session (its cache is nowhere: the
  winner holds nothing; or it is a shared prefix of at least ``session_min_shared_s``,
  0.25 s of prefill, such as an agent's tool preamble, that two or more open holders
  hold in full) brings the session's later requests to wherever it lands, and the
  load terms see none of that work yet. On the open-loop agent workload three tasks
  that started within 3.5 s all went to the node that looked idlest; their steps, each
  an incremental prefill attending over a 10k-30k-token context, kept its prefill busy
  70 % of the time while other nodes sat at 5-25 %, and its decode steps passed the
  100 ms TPOT target (seed 2 at 0.95 of saturation: 124 TPOT misses, dynamo_cost 19).
  Such a request goes, among the nodes it could start on (the non-holders, or those
  holders) whose predicted first token (penalty less bonus) is within
  ``session_spread_s`` (0.5 s; ``session_spread_shared_s``, 1 s, on a shared prefix)
  of the winner's, to the one with the least recent work: the prefill seconds this
  policy sent there, decayed over ``recent_work_tau_s`` (10 s), with ``session_work_s``
  (4 s, about an agent task's) counted ahead for each new session. Over seeds 0-3 at
  0.8 / 0.95 of round robin's saturation (averages, with 0.5 s for both windows): agent
  TTFT p99 0.714 / 1.347 s became 0.569 / 0.661 s, TTFT mean 0.241 / 0.284 s 0.233 /
  0.246 s, goodput 7.67 / 8.86 requests/s 7.77 / 9.00 (dynamo_cost 7.79 / 9.12); gsp
  load max/mean 1.12 / 1.18 became 1.03 / 1.04 and goodput 31.90 / 36.29 32.02 / 36.92.
  Chat (a 1 024-token system prompt, under the minimum) is unchanged, and so, nearly,
  is the conversation trace, where half the requests share only its first block: over
  eight replays at 0.8 / 0.95, TTFT p99 17.095 / 17.408 s against 17.087 / 17.402 s,
  hit ratio 0.1745 / 0.1711 against 0.1745 / 0.1708. Without the minimum it moved
  3 636 of that trace's 12 031 decisions, and its TTFT mean rose to 1.529 / 1.646 s
  from 1.520 / 1.636 s; a slack of 0.1-0.2 s left agent sessions herding.

  A session on a shared prefix looks twice as far: with 0.5 s, on the agent workload
  at 0.95 of saturation (seed 7), eight tasks started within 2.5 s while two nodes had
  nothing queued and the others 0.9-8 s; only those two were within 0.5 s of the
  winner, the new tasks alternated between them, and three long ones (16-19 steps,
  contexts up to 30k tokens) on one of them made 48 of the run's 88 TPOT misses
  (dynamo_cost 4). With 1 s, paired over seeds 0-15 at 0.95, TTFT mean fell 0.020 s
  (95 % interval -0.038 .. -0.002), TPOT p99 0.025 s (-0.041 .. -0.009), TTFT p99 0.56
  s (-1.17 .. +0.04), and goodput rose 0.166 requests/s (+0.056 .. +0.277); at 0.8 every
  difference is within noise (TTFT p99 +0.06 s, -0.04 .. +0.17). Chat and gsp (shared
  prefixes under the minimum) do not change; the conversation trace's decisions at 0.8
  are the same, and at 0.95 its eight replays' means moved by 0.007 s of TTFT p99,
  0.001 s of TTFT mean and 0.0004 of hit ratio, all within noise (the issue's run is the
  same). One window of 0.75 s for both did about as well at 0.95 on seeds 8-15, and 2 s
  no better than 1 s on seeds 0-7. A cold session keeps 0.5 s: 1 s for both took away what the
  eviction pre-announcement buys on ``--workload zipf --cache-blocks 300`` (the
  ``mass_eviction`` scenario, seeds 0-3: hit ratio 0.6707 / 0.5590 / 0.6286 / 0.6252
  announced against 0.6765 / 0.5658 / 0.6403 / 0.6181 unannounced; with first copies
  held to exploration's no-later clause, 0.7335 / 0.6167 / 0.6858 / 0.6969 against
  0.7339 / 0.6235 / 0.6841 / 0.6918).
  A cold session's window no wider than its own prefill (gsp's first request of a group,
  2 176 tokens, about 0.16 s, may otherwise wait up to 0.5 s for a node with less
  recent work) left gsp's TTFT p99 where preble_e2 ties it (0.1805 / 0.1837 s became
  0.1800 / 0.1828 s, seeds 0-7 at 0.8 / 0.95; preble_e2 0.1800 / 0.1838 s) and put its
  load max/mean up from 1.013 / 1.022 to 1.089 / 1.107.
  ``session_spread_s=0`` turns it off, both windows.

  Tried and left out: a shared prefix that one holder alone holds (an agent tool
  preamble not yet copied) taken as a new session's once two different continuations of
  it were seen, with the non-holders in the pool. On the agent workload (seed 0, 0.8 of
  saturation) two tasks that started within 0.1 s joined a node already running a
  20-step task, and all 23 of the run's TPOT misses were on that node (dynamo_cost:
  none); the rule saw them, but the holder had the least recent work (its one task was
  young; the idle nodes had just finished theirs) and kept them. Over seeds 0-7 nothing
  moved beyond noise, nor with ``recent_work_tau_s`` at 20 or 30 s. Ranking the pool by
  recent work plus ``decode_s_per_context_token`` times the context tokens in flight on
  the node (the work its live sessions still bring) put agent's TTFT p99 up by 0.12 /
  0.09 s and TTFT mean by 0.003 / 0.005 s (at 0.95 beyond noise). Nor did a shorter
  decay, so that a node whose tasks have just ended looks free sooner
  (``recent_work_tau_s`` 3 / 5 s), or ``session_work_s`` 8 s move anything beyond noise
  (seeds 0-7 at 0.8 / 0.95 of saturation; agent TPOT p99 at 0.95 +0.008 / +0.006 /
  +0.001 s, TTFT p99 +0.18 / +0.16 / -0.005 s; gsp and chat within 0.02 s). Most of the
  agent workload's remaining TPOT misses are that single-holder case (seed 1 at 0.95:
  tasks 9 and 12 joined task 7, 1.2 and 2.8 s younger, on the only holder of their
  tool preamble; the first copy to an idle node failed the no-later clause by 0.03 s,
  and 22 of the run's 53 TPOT misses were theirs; 14 more were those of tasks 15 and
  17, 0.9 s apart on the only holder of another preamble). Taking the second task as a
  new session too (the holder's prefix had been seen continued by another full block:
  a map of the successor of each of the last 65 536 full blocks routed; the non-holders
  in the pool, and the affinity slack not pulling it back) helped that seed (TPOT p99
  0.124 -> 0.105 s, goodput 10.59 -> 10.84 requests/s) but over seeds 0-7 at 0.8 / 0.95
  moved agent within noise (TPOT p99 -0.005 / +0.006 s, TTFT p99 -0.06 / +0.15 s,
  goodput +0.017 / -0.001) and left gsp and chat as they were.
  Nor did ranking the pool by the requests a node is running or finished within the
  last 3 s (an agent's next step comes 1-3 s after its last), ahead of recent work: the
  agent workload's SLO misses over seeds 0-7 went from 5.1 / 12.6 a run (0.8 / 0.95) to
  33.6 / 80.3. Counting 0.5 / 1 s of recent work for each request that continues a
  session (so a node running a long task does not look free between its steps) gave
  4.8 / 22.3 and 4.5 / 20.5, a single seed's count moving between 0 and 84 either way.

* **Fleet home.** One gateway of a fleet (``ctx.fleet``: ``expected_gateways`` above
  1) learns the cache only from its own routing, so a session's next request, coming
  through another gateway, found no holder and went wherever that gateway's load said:
  with four gateways the chat workload's hit ratio was 0.53 against 0.67 with one, and
  the extra prefill was the extra load. In a fleet a request whose cache no single
  holder has (nothing matched, or two or more holders of the longest match, such as a
  system prompt; the winner holding no more than that) goes, among the candidates
  whose predicted first token is within ``fleet_home_s`` (0.25 s) of the winner's, to
  the one with the highest xxh3 hash of (the prompt's first block past that match,
  node id), in place of the new-session spread. Gateways that know the same shared
  prefix pick the same block, so the whole fleet sends a new session to the same node
  and its later requests, through any gateway, find their cache there. With four
  gateways (seeds 0-3, 0.8 / 0.95 of saturation) chat's hit ratio went from 0.527 to
  0.600, its TTFT p99 from 0.503 / 2.227 s to 0.330 / 1.359 s and mean from 0.143 /
  0.694 s to 0.112 / 0.340 s; agent's SLO misses from 666 / 1760 to 566 / 1526; gsp's
  TTFT mean from 0.087 / 0.135 s to 0.064 / 0.073 s (its p99 0.419 / 0.773 s became
  0.464 / 0.524 s: a home draws a group's requests to one node). With two gateways gsp's
  p99 rose from 0.31 to 0.40 s, chat's and agent's fell. A window of 0.5 s hit more
  (chat 0.63) but with two gateways put agent tasks together (SLO misses 124 / 393 ->
  192 / 475). A lone gateway never uses it.

On top of the score, in this order:

1. **Breaker per holder.** A node whose queue reaches ``breaker_open_queue`` loses
   its cache bonus until its queue falls to ``breaker_close_queue`` (hysteresis, so
   a holder hovering at the threshold does not flap); so does, while it lasts, a node
   with as many requests running or waiting as its ``capacity`` (the concurrency it
   serves well, its share of the budget): ours in flight there, or what it reported
   when that is more (other gateways' too). The queue counts only prefill not yet
   started, so without the second rule a holder gathers decodes without bound: under
   a P2 flood at 0.8 of saturation (chat, seed 0) the P0 sessions that followed their
   caches put 150-250 requests on two or three nodes while the others ran 1-7, and
   their slower decode held the credits that P0 arrivals then queued for.
2. **Spread.** Several holders of the same prefix compete on load through the same
   score (equal bonus, different penalty), so the prefix is spread among its
   holders before affinity is given up.
3. **Hot-prefix replication.** When the request's hot prefix arrives faster than
   ``replica_rps`` per current holder, and it has fewer than ``max_replicas``
   holders, the request goes to the least-loaded non-holder: one more replica.
4. **Exploration.** When the winner is a cache hit and a node is idle, with
   probability ``epsilon`` (1.0: every time) that idle node, which misses, gets the
   request instead, so idle nodes warm up. Idle means idle: nothing queued, nothing of
   ours in flight, KV utilisation at most ``idle_util``. Only a hit saving at most
   ``explore_max_loss_s`` (1 s) of predicted prefill is given up this way: that warms
   a node with a shared prefix (a system prompt, an agent's tool prefix) and spreads
   new sessions, while a session's own long context sent to an idle node is not a
   warm-up but a second copy and a slow first token (on the agent workload, 5 % of all
   hits explored made most of the TTFT tail and all of the hit ratio kvgate lost to
   preble_e2). The brief suggests about 5 % of requests, at random; here the
   conditions keep it small, not the coin: 28 of the 1 209 requests of the open-loop
   agent workload (seed 0, 0.8 of round robin's saturation), 7 of 12 031 on the
   conversation trace, 7 of 1 127 on chat, 2 of 1 024 on gsp. On a quiet cluster,
   where every node is idle, a prefix one node holds stays there (nobody waits for
   it); once two nodes hold it, the next requests sharing it warm one idle node each
   before they hit (a lower ``epsilon`` makes that rarer). At 0.05 the bounded form
   left closed-loop agent sessions on a few nodes (load max/mean 1.58 / 1.93 at 0.8 /
   0.95 of saturation, where 0.2 gave 1.10 / 1.19). At 0.2 a new agent task whose
   tool prefix only one busy node held stayed there four times in five (the affinity
   slack held it: about 3 s to its first token against 0 s on an idle node, for 0.58 s
   of prefill saved) while other nodes sat idle, and that node's decode batches then
   missed the TPOT target: on the open-loop agent workload over seeds 0-3, TTFT p99
   0.787 / 1.718 s at 0.8 / 0.95 of saturation with 0.2 against 0.722 / 1.176 s with
   1.0, TTFT mean 0.252 / 0.293 against 0.243 / 0.272 s, goodput 7.61 / 8.82 against
   7.66 / 8.95 requests/s (dynamo_cost: 1.645 / 2.629 s, 0.303 / 0.422 s, 7.79 / 9.12
   requests/s: it misses the TPOT target less often). The bound alone
   still let a session's own context under 1 s go (an agent task's second to fifth
   steps, 8k-11k tokens), so the hit must also be shared: what the winner holds beyond
   the longest match of another candidate saves at most ``affinity_min_gain_s`` (less
   than a block). A first copy (no other candidate holds any of it) cannot be told from
   a session's own context yet: the ttft form holds it to the no-later clause below,
   the brief form copies it (how exploration starts there); and
   while the winner is idle itself, only a prefix another candidate holds in full is
   copied (nobody waits for the hit, and a first copy on a quiet cluster is as likely
   a chat session's second turn). A hit with a context of its own is explored only if
   the idle node's penalty plus the lost prefill plus the blocking cost of the whole
   prefill there is at most the winner's penalty (ttft form): its first token comes
   no later, and the idle node's own sessions, coming back to its cache, are not
   stuck behind it. On the closed-loop agent workload at 0.8 / 0.95 of saturation,
   explored second to fifth steps (0.85-1.34 s to first token, the whole prefill at
   the idle node) and the idle node's own sessions, back from their tool calls and
   queued behind that prefill, were most of the 24 slowest requests: TTFT p99 0.881
   / 0.935 s against preble_e2's 0.833 / 0.848; the sharing rule gives 0.652 / 0.689
   s. Without the no-later clause open-loop agent sessions piled onto their holders
   (TPOT p99 0.106 -> 0.135 s at 0.95, goodput 7.62 -> 7.46 requests/s); with it 0.100 s, 7.64.
   Without the blocking cost in that clause, on the seed-2 workload at 0.95 a task
   explored to a node whose own sessions then waited ~1.45 s behind it (p99 0.979 s
   against preble_e2's 0.973); with it 0.741 s, and 0.625 / 0.701 s at seed 0.
   A prefix other candidates hold too leaves without that clause; holding it to the
   clause let agent tasks herd again (seed 1 at 0.95 of saturation: TTFT p99 +2.28 s
   without the blocking cost in it, +2.40 s at seed 3 with it). First copies left
   without it too until this stop: on gsp two to four a run (a group's 4-block prefix
   copied to an idle node) were all kvgate's hit ratio lacked of preble_e2's and the
   ideal's, -0.0014 / -0.0012 over seeds 0-7 at 0.8 / 0.95, beyond the replays' noise;
   held to the clause, -0.0002 / -0.0005, within it. On ``--workload zipf`` (x1, eight
   replays) the hit ratio rose from 0.695 to 0.750 and TTFT mean fell from 0.264 to
   0.220 s (TTFT p99 the same, load max/mean 1.37 to 1.44); the agent workload moved
   within noise over seeds 0-15 (TTFT p99 -0.04 / +0.04 s at 0.8 / 0.95), chat too, and
   the conversation trace's eight replays at 0.8 / 0.95 are the same. With the new
   session spread's 0.5 s window for shared prefixes (below) this had put agent's TTFT
   p99 at 0.95 up by 0.29 s on average (0.3-1.1 s on three seeds of 0-7). The
   clause values the lost hit at its prefill time, where the score values a hit
   ``cache_gain`` times; at 2 or 5 times (seeds 0-7) gsp's remaining explorations
   stopped (hit ratio +0.0002 / +0.0005 at 0.8 / 0.95, within noise) but agent's TTFT
   p99 at 0.95 rose by 0.47 / 0.44 s and its goodput fell by 0.07 / 0.14 requests/s:
   exploration is what spreads agent tasks.

   **Busy exploration** (``explore_busy``, on). With no node idle, a hit on a prefix
   other candidates hold too (the winner holds at most ``affinity_min_gain_s`` beyond
   another's match) goes to the least loaded non-holder when it would answer no later
   by the same clause; not for a new session the spread or the fleet home placed (they
   weigh the work it brings), nor to a node another tenant's flood is confined to.
   Idleness alone let a node that missed the warm-up stay out for good: in the
   ``tenant_flood`` scenario a flood confined to one node from the run's first seconds
   kept its four requests in flight there, so that node was never idle and never got
   the system prompt, and the slack kept every other tenant's request on the holders
   for it (0.085 s of prefill); one node of eight served four requests while the
   others queued (chat at 0.95 of saturation, seeds 0-3: the other tenants' TTFT p99
   2.30 / 1.89 / 4.43 / 0.62 s against 0.76 / 0.75 / 0.59 / 0.24 s without the flood;
   with the rule 1.08 / 1.03 / 1.15 / 0.26 s). Once a node holds the prefix the rule
   has nothing left to do: the conversation trace and the chat and agent workloads
   give the same numbers with it and without (seeds 0-3, 0.8 / 0.95), gsp a hit ratio
   0.0004 lower. A non-holder that wins the score starts a new session instead (the
   spread places it and the slack may hold it), so the rule moves hits, not sessions.

Exactly one ``rng.random()`` is drawn per decision, so a seeded driver replays
the same decisions whatever the cluster state.

Cost
----
Routing runs per request over every candidate, so the load part of the score is kept
per node in best-first order (:mod:`kvgate.core.routing.kvgate_loads`) and
recomputed only for nodes whose load changed (the node table's load journal), for
nodes with prefill queued when the drain clock ticks, when a fresh report may have
gone stale (``now`` passed the oldest fresh report's bound), or on a membership
change. What the policy remembers across requests (each node's cache value and
recent work, the tail level) is in :mod:`kvgate.core.routing.kvgate_memory`. Per
request, only the holders (the nodes in ``matches``, usually a few) are scored in
Python; the best non-holder is the first candidate non-holder in that order.
Replication and exploration targets are looked for only when those branches can
fire, and so are the tail guard's (every candidate, for a request whose choice is
past the level: about one in a hundred) and the new-session spread's (the holders of
the shared prefix, or the non-holders within ``session_spread_s`` of the winner, in
load order); the tail level costs an insertion into a sorted list of ``tail_window``
entries per request. Decisions are the same as scoring every candidate in one loop
(tests/core/test_kvgate_reference.py checks this).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvgate.core.errors import ConfigError
from kvgate.core.ids import BlockChain, NodeId
from kvgate.core.nodes import NodeState, NodeTable, rendezvous_rank
from kvgate.core.rng import Rng
from kvgate.core.routing.base import RouteContext, RouteDecision, RouteReason
from kvgate.core.routing.kvgate_loads import PRESSURE_UTIL, Load, LoadScores
from kvgate.core.routing.kvgate_memory import DecayedSeconds, TailLevel

_INF = float("inf")


class _Scan:
    """What the score over the candidates found (:meth:`KvgatePolicy._scan`)."""

    __slots__ = (
        "best",
        "best_bonus",
        "best_match",
        "best_match_tripped",
        "holders_at_best",
        "hot_holders",
        "open_holders",
        "soonest",
        "soonest_bonus",
        "soonest_s",
        "w_cache",
        "w_load",
        "win_score",
    )

    best: Load  # the winner
    best_bonus: float  # its bonus
    win_score: float  # its score
    best_match: int  # the longest match among the candidates
    holders_at_best: int  # how many hold it
    best_match_tripped: bool  # whether the breaker is open on all of them
    hot_holders: int  # the holders of a hot prefix
    open_holders: list[tuple[Load, float]]  # holders whose breaker is shut, their bonus
    soonest: Load | None  # the soonest predicted first token (penalty less bonus)
    soonest_bonus: float  # its bonus
    soonest_s: float  # its penalty less bonus
    w_cache: float  # the weights of the form
    w_load: float


class KvgatePolicy:
    name: ClassVar[str] = "kvgate"
    uses_cache: ClassVar[bool] = True

    def __init__(
        self,
        *,
        w_cache: float = 3.0,
        w_load: float = 1.0,
        max_prefix_len: int = 8192,
        max_queue: int = 32,
        util_weight: float = 0.3,
        breaker_open_queue: int = 24,
        breaker_close_queue: int = 12,
        epsilon: float = 1.0,
        idle_queue: int = 0,
        idle_util: float = 0.2,
        replica_rps: float | None = None,
        max_replicas: int = 4,
        form: str = "ttft",
        prefill_tokens_per_s: float = 12_000.0,
        kv_pressure_s: float = 5.0,
        decode_s: float = 3.0,
        cache_gain: float = 5.0,
        attention_s_per_pair: float = 3.4e-9,
        blocking_cost: float = 3.0,
        blocking_min_s: float = 1.0,
        cache_value_tau_s: float = 30.0,
        affinity_slack_s: float = 20.0,
        affinity_min_gain_s: float = 0.03,
        affinity_short_gain_s: float = 0.25,
        affinity_short_slack_s: float = 4.0,
        explore_max_loss_s: float = 1.0,
        decode_s_per_context_token: float = 1.74e-5,
        max_cache_wait_s: float = 20.0,
        tail_quantile: float = 0.99,
        tail_window: int = 1000,
        session_spread_s: float = 0.5,
        session_spread_shared_s: float = 1.0,
        session_work_s: float = 4.0,
        session_min_shared_s: float = 0.25,
        recent_work_tau_s: float = 10.0,
        ttft_target_s: float = 0.0,
        fleet_home_s: float = 0.25,
        explore_busy: bool = True,
    ) -> None:
        if form not in ("ttft", "brief"):
            raise ConfigError("kvgate policy: form must be 'ttft' or 'brief'")
        if prefill_tokens_per_s <= 0:
            raise ConfigError("kvgate policy: prefill_tokens_per_s must be > 0")
        if max_prefix_len < 1 or max_queue < 1:
            raise ConfigError("kvgate policy: max_prefix_len and max_queue must be >= 1")
        if breaker_close_queue > breaker_open_queue:
            raise ConfigError("kvgate policy: breaker_close_queue must be <= breaker_open_queue")
        if not 0.0 <= epsilon <= 1.0:
            raise ConfigError("kvgate policy: epsilon must be in [0, 1]")
        nonnegative = {
            "blocking_cost": blocking_cost,
            "blocking_min_s": blocking_min_s,
            "affinity_slack_s": affinity_slack_s,
            "affinity_min_gain_s": affinity_min_gain_s,
            "affinity_short_gain_s": affinity_short_gain_s,
            "affinity_short_slack_s": affinity_short_slack_s,
            "explore_max_loss_s": explore_max_loss_s,
            "decode_s_per_context_token": decode_s_per_context_token,
            "max_cache_wait_s": max_cache_wait_s,
            "session_spread_s": session_spread_s,
            "session_spread_shared_s": session_spread_shared_s,
            "session_work_s": session_work_s,
            "session_min_shared_s": session_min_shared_s,
            "ttft_target_s": ttft_target_s,
            "fleet_home_s": fleet_home_s,
        }
        for key, value in nonnegative.items():
            if math.isnan(value) or value < 0:
                raise ConfigError(f"kvgate policy: {key} must be >= 0")
        if math.isinf(decode_s_per_context_token) or math.isinf(blocking_cost):
            raise ConfigError(
                "kvgate policy: decode_s_per_context_token and blocking_cost must be finite"
            )
        if cache_value_tau_s <= 0 or recent_work_tau_s <= 0:
            raise ConfigError("kvgate policy: cache_value_tau_s and recent_work_tau_s must be > 0")
        if not 0.0 <= tail_quantile < 1.0:
            raise ConfigError("kvgate policy: tail_quantile must be in [0, 1) (0: no tail guard)")
        if tail_window < 1:
            raise ConfigError("kvgate policy: tail_window must be >= 1")
        if not isinstance(explore_busy, bool):
            raise ConfigError("kvgate policy: explore_busy must be true or false")
        self.w_cache = w_cache
        self.w_load = w_load
        self.max_prefix_len = max_prefix_len
        self.max_queue = max_queue
        self.util_weight = util_weight
        self.breaker_open_queue = breaker_open_queue
        self.breaker_close_queue = breaker_close_queue
        self.epsilon = epsilon
        self.idle_queue = idle_queue
        self.idle_util = idle_util
        self.replica_rps = replica_rps
        self.max_replicas = max_replicas
        self.form = form
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.kv_pressure_s = kv_pressure_s
        self.decode_s = decode_s
        self.cache_gain = cache_gain
        self.attention_s_per_pair = attention_s_per_pair
        self.blocking_cost = blocking_cost
        self.blocking_min_s = blocking_min_s
        self.affinity_slack_s = affinity_slack_s
        self.affinity_min_gain_s = affinity_min_gain_s
        self.affinity_short_gain_s = affinity_short_gain_s
        self.affinity_short_slack_s = affinity_short_slack_s
        self.explore_max_loss_s = explore_max_loss_s
        self.decode_s_per_context_token = decode_s_per_context_token
        self.max_cache_wait_s = max_cache_wait_s
        self._cache_value = DecayedSeconds(cache_value_tau_s)
        self.tail_quantile = tail_quantile
        self.tail_window = tail_window
        self.session_spread_s = session_spread_s
        self.session_spread_shared_s = session_spread_shared_s
        self.session_work_s = session_work_s
        self.session_min_shared_s = session_min_shared_s
        # per node, the prefill seconds sent there lately, new sessions counted ahead
        self._recent_work = DecayedSeconds(recent_work_tau_s)
        # the tail guard's level (None: the guard is off)
        self._tail = TailLevel(tail_quantile, tail_window) if tail_quantile > 0 else None
        # the TTFT target caps the tail guard's level (0: no target)
        self.ttft_target_s = ttft_target_s
        self.fleet_home_s = fleet_home_s
        self.explore_busy = explore_busy
        self._tripped: set[NodeId] = set()  # holders whose breaker is open
        self._loads = LoadScores()

    @property
    def uses_hot_rate(self) -> bool:
        return self.replica_rps is not None  # only replication reads the rate

    def on_first_token(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_finished(self, node_id: NodeId, now: float, request_id: str = "") -> None:
        return None

    def on_node_removed(self, node_id: NodeId) -> None:
        self._tripped.discard(node_id)
        self._cache_value.forget(node_id)
        self._recent_work.forget(node_id)

    def _breaker_open(self, node_id: NodeId, queue: int) -> bool:
        tripped = self._tripped
        if node_id in tripped:
            if queue <= self.breaker_close_queue:
                tripped.discard(node_id)
                return False
            return True
        if queue >= self.breaker_open_queue:
            tripped.add(node_id)
            return True
        return False

    def select(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        matches: Mapping[NodeId, int],
        nodes: NodeTable,
        rng: Rng,
        now: float,
    ) -> RouteDecision | None:
        if not candidates:
            return None
        draw = rng.random()
        ttft = self.form == "ttft"
        loads, cands = self._load_scores(ctx, candidates, nodes, now, ttft)
        # the score: the winner among the holders and the best non-holder
        scan = self._scan(ctx, loads, cands, matches, ttft)
        best, best_bonus, win_score = scan.best, scan.best_bonus, scan.win_score
        new_session = False
        if ttft:
            # the rules that look past the request itself
            best, best_bonus, win_score, new_session = self._ttft_rules(
                ctx, loads, cands, matches, scan, now
            )
        chosen = best.state
        chosen_match = matches.get(best.node_id, 0)
        reason = self._reason(
            chosen_match,
            scan.best_match,
            scan.holders_at_best,
            best_bonus,
            scan.best_match_tripped,
        )
        prompt, tpb = ctx.prompt_tokens, ctx.tokens_per_block

        # Hot-prefix replication: one more holder when the holders cannot keep up.
        least: NodeState | None = None
        if (
            self.replica_rps is not None
            and scan.hot_holders
            and scan.hot_holders < self.max_replicas
            and ctx.hot_rate > self.replica_rps * scan.hot_holders
        ):
            least = _least_loaded(candidates, matches, loads.by_id)
        if least is not None:
            chosen, reason, chosen_match = least, RouteReason.REPLICATION, 0
        # Exploration: a small share of cache hits goes to an idle node that misses.
        elif (
            chosen_match
            and draw < self.epsilon
            and (loss := self._saved_s(prompt, chosen_match * tpb)) <= self.explore_max_loss_s
        ):
            idle = self._explore_to(
                ctx, candidates, loads, cands, matches, best, loss, new_session, now
            )
            if idle is not None:
                chosen, reason, chosen_match = idle, RouteReason.EXPLORATION, 0

        if ttft and self.session_spread_s > 0.0:
            # the prefill sent, and the work a new session is expected to bring
            work = self._uncached_s(prompt, chosen_match * tpb)
            if new_session:
                work += self.session_work_s
            self._recent_work.add(chosen.spec.node_id, work, now)
        if ttft and self.blocking_cost > 0.0 and chosen is best.state and best_bonus > 0.0:
            # what this hit saves, in prefill seconds: the node's cache value
            saved = min(chosen_match * tpb, prompt)
            self._cache_value.add(best.node_id, saved * (1.0 / self.prefill_tokens_per_s), now)

        parts: dict[str, float] = {
            "bonus": best_bonus,
            "penalty": best.penalty,
            "queue": float(best.queue),
            "w_cache": scan.w_cache,
            "w_load": scan.w_load,
        }
        return RouteDecision(
            node_id=chosen.spec.node_id,
            reason=reason,
            matched_blocks=chosen_match,
            best_matched_blocks=scan.best_match,
            score=win_score,
            parts=parts,
        )

    def _load_scores(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        nodes: NodeTable,
        now: float,
        ttft: bool,
    ) -> tuple[LoadScores, frozenset[NodeState]]:
        """Every node's load terms brought up to date, and the candidates as a set."""
        params = (
            self.w_load,
            self.max_queue,
            self.util_weight,
            nodes.stale_after_s,
            ttft,
            self.prefill_tokens_per_s,
            self.kv_pressure_s,
            self.decode_s,
            self.attention_s_per_pair,
            self.decode_s_per_context_token,
        )
        loads = self._loads
        loads.sync(nodes, now, params)
        # Membership in the candidates: usually they are the table's eligible pool as
        # the controller passes it (nothing filtered per request), whose set is kept.
        cands = loads.candidate_set(nodes, ctx.model)
        if candidates != loads.pool_list:
            cands = frozenset(candidates)
            if len(cands) != len(candidates) or not cands <= loads.states:
                # Outside the contract (candidates are distinct nodes of the table):
                # score just these, by the same rules, without touching the cache.
                loads = LoadScores()
                loads.rebuild(nodes, candidates, now, params)
        return loads, cands

    def _scan(
        self,
        ctx: RouteContext,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        ttft: bool,
    ) -> _Scan:
        """The score over the candidates: every holder scored, then the best non-holder
        (the first in rank order), with what the later rules need of them."""
        by_id = loads.by_id
        tpb = ctx.tokens_per_block
        prompt = ctx.prompt_tokens
        if ttft:
            # seconds: the bonus is the prefill time saved (uncapped), counted cache_gain
            # times, because a hit also spares the node work that later requests wait on
            inv_prefix, cap = 1.0 / self.prefill_tokens_per_s, _INF
            attn_half = self.attention_s_per_pair / 2
            w_cache, w_load = self.cache_gain, 1.0
        else:
            inv_prefix, cap = 1.0 / self.max_prefix_len, 1.0
            attn_half = 0.0
            w_cache, w_load = self.w_cache, self.w_load
        hot_blocks = ctx.hot_blocks
        tripped_set, open_queue = self._tripped, self.breaker_open_queue
        discount = ctx.cache_discount  # usually empty

        best: Load | None = None
        best_key = (-_INF, 0, 0)  # (score, -queue, -slot): the highest wins
        best_score = -_INF  # best_key[0]
        best_bonus = 0.0
        best_match = 0  # longest match among candidates
        holders_at_best = 0
        best_match_tripped = False
        hot_holders = 0
        # the open holders and their bonus, for the affinity slack and the tail guard
        track_open = ttft and (
            self.affinity_slack_s > 0.0
            or self._tail is not None
            or self.ttft_target_s > 0.0
            or ctx.ttft_target_s > 0.0
            or self.session_spread_s > 0.0
            or self.fleet_home_s > 0.0
        )
        open_holders: list[tuple[Load, float]] = []
        # the soonest predicted first token: (penalty less bonus, queue, slot), its bonus
        soonest: Load | None = None
        soonest_key = (_INF, 0, 0)
        soonest_bonus = 0.0
        # The holders: the only candidates whose score depends on the request.
        for nid, m in matches.items():
            load = by_id.get(nid)
            if load is None or not m or load.state not in cands:
                continue
            q = load.queue
            if hot_blocks and m >= hot_blocks:
                hot_holders += 1
            # the queue's breaker first: its hysteresis follows the queue either way
            tripped = (
                (q >= open_queue or nid in tripped_set) and self._breaker_open(nid, q)
            ) or _at_capacity(load.state)
            if m > best_match:
                best_match, best_match_tripped, holders_at_best = m, tripped, 1
            elif m == best_match:
                holders_at_best += 1
                best_match_tripped = best_match_tripped and tripped
            if tripped:
                bonus = 0.0
                score = -w_load * load.penalty
            else:
                # min(m * tpb, prompt) and min(saved / max_prefix_len, 1), without the calls
                saved = m * tpb
                if saved > prompt:
                    saved = prompt
                # ttft: the prefill time of the cached prefix, a*h + c*h^2/2 (attn = c)
                bonus = saved * inv_prefix + attn_half * saved * saved
                if bonus > cap:
                    bonus = cap
                bonus *= (
                    load.state.cache_weight * discount.get(nid, 1.0)
                    if discount
                    else load.state.cache_weight
                )
                score = w_cache * bonus - w_load * load.penalty
                if track_open and bonus > 0.0:
                    open_holders.append((load, bonus))
            if ttft and (tkey := (load.penalty - bonus, q, load.slot)) < soonest_key:
                soonest, soonest_key, soonest_bonus = load, tkey, bonus
            if score >= best_score:
                key = (score, -q, -load.slot)
                if key > best_key:
                    best, best_key, best_score, best_bonus = load, key, score, bonus
        # Every non-holder scores -w_load * penalty: the best is the first candidate
        # non-holder in rank order (usually the first rank or close to it).
        for _, q, slot, load in loads.order:
            if load.state in cands and not matches.get(load.node_id):
                key = (load.score, -q, -slot)
                if key > best_key:
                    best, best_key, best_bonus = load, key, 0.0
                if ttft and (tkey := (load.penalty, q, slot)) < soonest_key:
                    soonest, soonest_key, soonest_bonus = load, tkey, 0.0
                break
        assert best is not None
        scan = _Scan()
        scan.best, scan.best_bonus, scan.win_score = best, best_bonus, best_key[0]
        scan.best_match, scan.holders_at_best = best_match, holders_at_best
        scan.best_match_tripped, scan.hot_holders = best_match_tripped, hot_holders
        scan.open_holders = open_holders
        scan.soonest, scan.soonest_bonus, scan.soonest_s = soonest, soonest_bonus, soonest_key[0]
        scan.w_cache, scan.w_load = w_cache, w_load
        return scan

    def _ttft_rules(
        self,
        ctx: RouteContext,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        scan: _Scan,
        now: float,
    ) -> tuple[Load, float, float, bool]:
        """The ttft form's rules past the score, in order: the blocking cost, a new
        session's home (in a fleet) or spread (alone), the bounded wait, the affinity
        slack, the tail guard. The winner, its bonus, its score and whether the request
        starts a new session."""
        best, best_bonus, win_score = scan.best, scan.best_bonus, scan.win_score
        best_match, open_holders, w_cache = scan.best_match, scan.open_holders, scan.w_cache
        prompt, tpb, discount = ctx.prompt_tokens, ctx.tokens_per_block, ctx.cache_discount
        # a new session (its cache is shared, or nowhere): in a fleet, to its prefix's
        # home; alone, where sessions work least
        new_session = False
        # each node's blocking cost, when the blocking rule rescored the request
        costs: Mapping[NodeId, float] = {}
        if self.blocking_cost > 0.0 and (
            self._uncached_s(prompt, matches.get(best.node_id, 0) * tpb) >= self.blocking_min_s
        ):
            best, win_score, best_bonus, costs = self._rescore_blocking(
                loads, cands, matches, prompt, tpb, w_cache, discount, now
            )
        # the latest predicted first token (penalty less bonus) a request waits for
        latest = scan.soonest_s + self.max_cache_wait_s
        moved = False
        home = None
        if (
            ctx.fleet
            and self.fleet_home_s > 0.0
            and not costs
            and (best_match == 0 or scan.holders_at_best >= 2)
        ):
            home = self._fleet_home(
                loads, cands, matches, open_holders, (best, best_bonus), best_match, ctx.chain,
                discount,
            )  # fmt: skip
        if home is not None:
            new_session = True
            if home[0] is not best:
                (best, best_bonus), moved = home, True
        elif self.session_spread_s > 0.0 and not costs:
            spread = self._spread_session(
                loads, cands, matches, open_holders, (best, best_bonus), best_match, prompt,
                tpb, now,
            )  # fmt: skip
            if spread is not None:
                new_session = True
                if spread[0] is not best:
                    (best, best_bonus), moved = spread, True
        soonest = scan.soonest
        if soonest is not None and best.penalty - best_bonus > latest:
            # the winner keeps it waiting too long for its cache: the soonest node
            best, best_bonus, moved = soonest, scan.soonest_bonus, True
        if (
            open_holders
            and (kept := self._within_slack(best, best_bonus, open_holders, costs, latest))
            is not None
        ):
            (best, best_bonus), moved = kept, True
        full = self._uncached_s(prompt, 0)
        level = self._tail.observe(full) if self._tail is not None else _INF
        if 0.0 < self.ttft_target_s < level:
            level = self.ttft_target_s
        if 0.0 < ctx.ttft_target_s < level:  # the request's own (a P0 SLO)
            level = ctx.ttft_target_s
        if (
            level < _INF
            and best.wait + self._uncached_s(prompt, matches.get(best.node_id, 0) * tpb) > level
        ):
            under = self._under_tail(
                loads, cands, matches, open_holders, costs, w_cache, prompt, tpb, full, level
            )
            if under is not None:
                (best, best_bonus), moved = under, True
        if moved:
            win_score = w_cache * best_bonus - best.penalty - costs.get(best.node_id, 0.0)
        return best, best_bonus, win_score, new_session

    def _explore_to(
        self,
        ctx: RouteContext,
        candidates: Sequence[NodeState],
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        best: Load,
        loss: float,
        new_session: bool,
        now: float,
    ) -> NodeState | None:
        """Where exploration sends a cache hit instead of its winner ``best`` (``loss``:
        the prefill seconds the hit would have saved), or None to keep it."""
        by_id = loads.by_id
        prompt, tpb = ctx.prompt_tokens, ctx.tokens_per_block
        chosen = best.state
        chosen_match = matches.get(best.node_id, 0)
        idle = _most_idle(candidates, matches, by_id, self.idle_queue, self.idle_util)
        # the longest match of any other candidate (only here: exploration is rare)
        other = max(
            (
                m
                for nid, m in matches.items()
                if nid != best.node_id and (o := by_id.get(nid)) is not None and o.state in cands
            ),
            default=0,
        )
        shared = self._shared(prompt, tpb, chosen_match, other)
        # The winner is idle itself, so nobody waits for its hit: only a prefix another
        # node holds in full is copied on (a system prompt warming a third node). A
        # first copy or a longer match waits until its holder is busy: on a quiet
        # cluster a chat session's second turn went to an idle node, and each later
        # turn whose new part was under the minimum gain went on again (index audit:
        # 3 engines, 12 sessions x 5 turns, 36 of 48 later turns explored, measured
        # hit ratio 0.18; with this rule 3-10 and 0.56-0.69 in two runs; with
        # epsilon 0, 0.72)
        keep = other < chosen_match and _is_idle(
            chosen, by_id[chosen.spec.node_id], self.idle_queue, self.idle_util
        )
        ttft = self.form == "ttft"
        if idle is not None and (
            keep
            or not (
                shared
                # a context of its own leaves only for a first token no later than there
                or (ttft and self._no_later_at(by_id[idle.spec.node_id], best, loss, prompt, now))
            )
        ):
            idle = None
        if (
            idle is None
            and not keep
            and ttft
            and self.explore_busy
            and shared
            and (not new_session)
        ):
            # no node is idle: the least loaded node that would answer no later still
            # gets a prefix other nodes hold too
            idle = self._underused(
                loads, cands, matches, ctx.cache_discount, best, loss, prompt, now
            )
        return idle

    def _within_slack(
        self,
        best: Load,
        best_bonus: float,
        open_holders: list[tuple[Load, float]],
        costs: Mapping[NodeId, float],
        latest: float,
    ) -> tuple[Load, float] | None:
        """The open holder that saves the most prefill (then the sooner first token,
        then the lower slot) among those saving at least ``affinity_min_gain_s`` more
        than the winner whose predicted TTFT is within ``affinity_slack_s`` of the
        winner's (within ``affinity_short_slack_s`` when it saves less than
        ``affinity_short_gain_s`` more) and whose penalty less bonus is at most
        ``latest`` (the bounded wait): it and its bonus; None if none.

        A predicted TTFT is the penalty plus the request's whole prefill less the bonus
        (the prefill the node's cache saves), so the prefill itself cancels out; a long
        prefill the blocking rule rescored also carries its blocking cost there."""
        start = best.penalty - best_bonus + costs.get(best.node_id, 0.0)
        limit = start + self.affinity_slack_s
        # a short gain (a short session's own turns) is worth only a short wait
        short_gain = best_bonus + self.affinity_short_gain_s
        short_limit = start + min(self.affinity_slack_s, self.affinity_short_slack_s)
        floor = best_bonus + self.affinity_min_gain_s
        kept: tuple[Load, float] | None = None
        kept_key = (-_INF, -_INF, 0)
        for load, bonus in open_holders:
            if bonus <= floor or load.util > PRESSURE_UTIL or load.penalty - bonus > latest:
                continue
            ttft = load.penalty - bonus + costs.get(load.node_id, 0.0)
            if ttft > (short_limit if bonus < short_gain else limit):
                continue
            if (key := (bonus, -ttft, -load.slot)) > kept_key:
                kept, kept_key = (load, bonus), key
        return kept

    def _under_tail(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        open_holders: list[tuple[Load, float]],
        costs: Mapping[NodeId, float],
        w_cache: float,
        prompt: int,
        tpb: int,
        full: float,
        level: float,
    ) -> tuple[Load, float] | None:
        """The tail guard, once the winner's predicted first token (its wait plus the
        prefill its cache leaves) is past ``level``: the best scored (then the lower
        queue, then the lower slot) of the candidates whose first token is not, open
        holders with their bonus, non-holders with none; and its bonus. None if none.
        ``full`` is the request's prefill with nothing cached."""
        top: tuple[Load, float] | None = None
        top_key = (-_INF, 0, 0)
        for load, bonus in open_holders:
            if load.wait + self._uncached_s(prompt, matches[load.node_id] * tpb) <= level:
                score = w_cache * bonus - load.penalty - costs.get(load.node_id, 0.0)
                if (key := (score, -load.queue, -load.slot)) > top_key:
                    top, top_key = (load, bonus), key
        for _, q, slot, load in loads.order:
            if load.wait + full <= level and load.state in cands and not matches.get(load.node_id):
                key = (-load.penalty - costs.get(load.node_id, 0.0), -q, -slot)
                if key > top_key:
                    top, top_key = (load, 0.0), key
        return top

    def _fleet_home(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        open_holders: list[tuple[Load, float]],
        winner: tuple[Load, float],
        best_match: int,
        chain: BlockChain,
        discount: Mapping[NodeId, float],
    ) -> tuple[Load, float] | None:
        """In a fleet, where a request whose cache no single holder has goes, and its
        bonus: among the candidates whose predicted first token (penalty less bonus) is
        within ``fleet_home_s`` of the winner's, the one with the highest xxh3 hash of
        (the prompt's first block past the shared match, node id) (:func:`rendezvous_rank`,
        as a pressing tenant's home node is chosen). Gateways that know the
        same shared prefix pick the same block, so the fleet sends a new session to the
        same node without a word, and its next request finds the cache there whichever
        gateway routes it. A node the request's ``discount`` marks (another tenant's
        flood is confined there) is nobody's home. None when the winner holds more of
        the prompt than the shared match (a context of its own) or the prompt has no
        full block, or no node qualifies."""
        best, best_bonus = winner
        if not chain or matches.get(best.node_id, 0) not in (0, best_match):
            return None
        key = chain[min(best_match, len(chain) - 1)]
        limit = best.penalty - best_bonus + self.fleet_home_s
        bonus_of = {load.node_id: bonus for load, bonus in open_holders}
        top: tuple[Load, float] | None = None
        top_rank = -1
        for load in loads.by_id.values():
            if load.state not in cands or (discount and load.node_id in discount):
                continue
            bonus = bonus_of.get(load.node_id, 0.0)
            if load.penalty - bonus <= limit:
                rank = rendezvous_rank(key, load.node_id)
                if rank > top_rank:
                    top, top_rank = (load, bonus), rank
        return top

    def _spread_session(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        open_holders: list[tuple[Load, float]],
        winner: tuple[Load, float],
        best_match: int,
        prompt: int,
        tpb: int,
        now: float,
    ) -> tuple[Load, float] | None:
        """When the request starts a new session, the node it goes to and its bonus;
        None when it does not. A new session's cache is nowhere (the winner holds
        nothing), or is a shared prefix of at least ``session_min_shared_s`` of prefill
        (a system prompt, an agent's tool preamble) that two or more open holders hold
        in full, the winner's whole match. Of the nodes it could start on (the
        non-holders, or those holders) whose predicted first token (penalty less bonus)
        is within ``session_spread_s`` of the winner's (``session_spread_shared_s`` on a
        shared prefix), it goes to the one with the least recent work (then the sooner
        first token, then the lower slot)."""
        best, best_bonus = winner
        m_best = matches.get(best.node_id, 0)
        # a session on a shared prefix (an agent task on its tool preamble) looks further
        window = self.session_spread_shared_s if m_best else self.session_spread_s
        limit = best.penalty - best_bonus + window
        pool: list[tuple[Load, float]]
        if m_best:
            shared_s = self._saved_s(prompt, m_best * tpb)
            if m_best != best_match or shared_s < self.session_min_shared_s:
                return None
            holders = [lb for lb in open_holders if matches[lb[0].node_id] == m_best]
            if len(holders) < 2:
                return None
            pool = [lb for lb in holders if lb[0].penalty - lb[1] <= limit]
        else:
            pool = []
            for _, _, _, load in loads.order:  # ascending penalty among non-holders
                if load.penalty > limit:
                    break
                if load.state in cands and not matches.get(load.node_id):
                    pool.append((load, 0.0))
        rate = self._recent_work.rate
        top = min(
            pool,
            key=lambda lb: (rate(lb[0].node_id, now), lb[0].penalty - lb[1], lb[0].slot),
            default=None,
        )
        return top if top is not None else winner

    def _underused(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        discount: Mapping[NodeId, float],
        best: Load,
        loss: float,
        prompt: int,
        now: float,
    ) -> NodeState | None:
        """The least loaded candidate non-holder (the first in rank order; not a node
        another tenant's flood is confined to, which ``discount`` marks) if it would
        answer no later than the winner (:meth:`_no_later_at`), else None."""
        for _, _, _, load in loads.order:
            if (
                load.state in cands
                and not matches.get(load.node_id)
                and not (discount and load.node_id in discount)
            ):
                return load.state if self._no_later_at(load, best, loss, prompt, now) else None
        return None

    def _no_later_at(self, idle: Load, best: Load, loss: float, prompt: int, now: float) -> bool:
        """Whether the idle node would answer no later than the winner: its penalty, plus
        the prefill the lost hit would have saved, plus the blocking cost of the whole
        prefill there (the idle node's own sessions come back to its cache and queue
        behind it) is at most the winner's penalty."""
        blocking = self._blocking_s(prompt, 0, idle.node_id, now)
        return idle.penalty + loss + blocking <= best.penalty

    def _shared(self, prompt: int, tpb: int, chosen_match: int, other: int) -> bool:
        """Whether the winner's hit of ``chosen_match`` blocks is a prefix exploration may
        copy as shared: what it holds beyond the longest match of another candidate,
        ``other`` blocks, saves at most ``affinity_min_gain_s`` of prefill (less than a
        block: no context of its own). A first copy (no other candidate holds any of it)
        cannot be told from a session's own context: the brief form copies it (how
        exploration starts there), the ttft form holds it to the no-later clause."""
        if not other:
            return self.form != "ttft"
        beyond = self._uncached_s(prompt, min(other, chosen_match) * tpb) - self._uncached_s(
            prompt, chosen_match * tpb
        )
        return beyond <= self.affinity_min_gain_s

    def _blocking_s(self, prompt: int, cached: int, node_id: NodeId, now: float) -> float:
        """The blocking cost of ``prompt``'s prefill (``cached`` tokens cached) on a node:
        ``blocking_cost`` x that prefill x the node's cache value rate (the prefill
        seconds per second our hits there have saved lately)."""
        cost = self.blocking_cost * self._uncached_s(prompt, cached)
        return cost * self._cache_value.rate(node_id, now)

    def _saved_s(self, prompt: int, cached: int) -> float:
        """Predicted prefill seconds that ``cached`` cached tokens of ``prompt`` save."""
        return self._uncached_s(prompt, 0) - self._uncached_s(prompt, cached)

    def _uncached_s(self, prompt: int, cached: int) -> float:
        """Predicted prefill seconds of ``prompt`` tokens of which ``cached`` are cached."""
        saved = min(cached, prompt)
        rest = prompt - saved
        return rest / self.prefill_tokens_per_s + self.attention_s_per_pair * rest * (
            saved + rest / 2
        )

    def _rescore_blocking(
        self,
        loads: LoadScores,
        cands: frozenset[NodeState],
        matches: Mapping[NodeId, int],
        prompt: int,
        tpb: int,
        w_cache: float,
        discount: Mapping[NodeId, float],
        now: float,
    ) -> tuple[Load, float, float, dict[NodeId, float]]:
        """Every candidate scored with the blocking cost of this request's prefill there:
        the winner, its score, its bonus and every candidate's blocking cost."""
        inv_rate = 1.0 / self.prefill_tokens_per_s
        attn_half = self.attention_s_per_pair / 2
        top: Load | None = None
        top_key = (-_INF, 0, 0)
        top_bonus = 0.0
        costs: dict[NodeId, float] = {}
        for load in loads.by_id.values():
            if load.state not in cands:
                continue
            m = matches.get(load.node_id, 0)
            bonus = 0.0
            if m and load.node_id not in self._tripped and not _at_capacity(load.state):
                saved = min(m * tpb, prompt)
                weight = load.state.cache_weight * discount.get(load.node_id, 1.0)
                bonus = (saved * inv_rate + attn_half * saved * saved) * weight
            blocking = self._blocking_s(prompt, m * tpb, load.node_id, now)
            costs[load.node_id] = blocking
            key = (w_cache * bonus - load.penalty - blocking, -load.queue, -load.slot)
            if key > top_key:
                top, top_key, top_bonus = load, key, bonus
        assert top is not None
        return top, top_key[0], top_bonus, costs

    @staticmethod
    def _reason(
        chosen_match: int,
        best_match: int,
        holders_at_best: int,
        bonus: float,
        best_match_tripped: bool,
    ) -> RouteReason:
        if chosen_match and bonus > 0:
            if chosen_match >= best_match and holders_at_best == 1:
                return RouteReason.CACHE_HIT
            return RouteReason.SPREAD  # one of several holders, picked by load
        if best_match and best_match_tripped:
            return RouteReason.BREAKER
        return RouteReason.LOAD


def _least_loaded(
    candidates: Sequence[NodeState], matches: Mapping[NodeId, int], by_id: Mapping[NodeId, Load]
) -> NodeState | None:
    """The non-holder candidate with the lowest penalty, then the lowest slot."""
    least: NodeState | None = None
    least_key = (_INF, 0)
    for s in candidates:
        if not matches.get(s.spec.node_id):
            key = (by_id[s.spec.node_id].penalty, s.slot)
            if key < least_key:
                least, least_key = s, key
    return least


def _is_idle(state: NodeState, load: Load, idle_queue: int, max_util: float) -> bool:
    """Really idle: queue <= idle_queue, nothing of ours in flight, KV utilisation <=
    max_util."""
    return load.queue <= idle_queue and load.util <= max_util and state.inflight == 0


def _most_idle(
    candidates: Sequence[NodeState],
    matches: Mapping[NodeId, int],
    by_id: Mapping[NodeId, Load],
    idle_queue: int,
    max_util: float,
) -> NodeState | None:
    """The least-utilised non-holder that is really idle: queue <= idle_queue, nothing of
    ours in flight, KV utilisation <= max_util (a busy cluster has none, and then
    exploration costs no hits)."""
    idle: NodeState | None = None
    idle_util = _INF
    for s in candidates:
        if not matches.get(s.spec.node_id):
            load = by_id[s.spec.node_id]
            if load.util < idle_util and _is_idle(s, load, idle_queue, max_util):
                idle, idle_util = s, load.util
    return idle


def _at_capacity(state: NodeState) -> bool:
    """Whether a node runs (or queues) as many requests as it serves well: ours in
    flight there, or what it last reported when that is more (other gateways' too)."""
    occupied = max(state.inflight, state.reported_running + state.reported_waiting)
    return occupied >= state.spec.capacity
