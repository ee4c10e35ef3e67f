"""How much all-to-all time each schedule hides: sequential, MoE-internal chunking (Tutel-style),
Overlapped, and Overlapped with deferred dW, on a stack of pre-norm attention + MoE blocks.

    python -m bench.overlap --device cpu --quick            # emulated link, CPU
    python -m bench.overlap --device cuda --json bench/results/overlap.json --png bench/results/overlap.png

Communication goes over the emulated link (lancet_rt.EmulatedGroup: this process is rank 0 of a
symmetric world of --world-size ranks). ``--comm-ratio R`` sets its bandwidth so that the modeled
communication of one training step (forward + backward) is R x the step's computation:
``compute_ms`` is the Overlapped schedule timed on a zero-cost link, and the bandwidth is
``off-rank bytes per step / (R * compute_ms - transfers * latency)`` (calibrated on a first short
pass; ``measured_comm_ratio`` reports the ratio against the final measurement).

Every schedule is timed on the free link (its own computation) and on the calibrated link, the
runs interleaved step by step, so that load from elsewhere on a shared machine hits all alike, and
summarised by the fastest step (``--statistic``). If the measured comm/compute ratio misses R by
more than 10%, the bandwidth is rescaled and everything measured again, once.

Metrics: ``hidden_comm_fraction = 1 - (overlapped_ms - compute_ms) / comm_ms`` (Overlapped;
``hidden_comm_fraction_dw`` likewise for Overlapped with deferred dW), and ``bound_ms =
max(compute_ms, comm_ms)``. A structural limit: the forward's all-to-alls (half the bytes) can
hide only behind the forward's computation (about a third of the step), so at R = 1 about a sixth
of the communication stays exposed even for a perfect schedule, and a step takes at least about
1.17 x bound_ms. The row therefore also carries the pass-aware bound, measured in the same run:
``pass_bound_ms = max(forward_compute_ms, forward_comm_ms) + max(backward compute, backward comm)``
(the backward cannot start before the loss has every chunk's output), ``over_pass_bound`` against
it, and ``max_hidden_comm_fraction``, the most any schedule could hide.

The row also carries ``chunking_overhead`` (Overlapped's free-link step over the sequential one,
the compute overhead of chunking) and, for the blocks model, the eager floor it is bounded
by: ``plain_chunks_compute_ms``, the unchunked model run on the chunks' rows one after another (no
Overlapped, no overlap, one backward), ``plain_chunks_overhead`` (that over the sequential step) and
``overhead_over_floor`` (Overlapped over that), the three timed interleaved on the free link. What the
floor costs above 1 is eager PyTorch running every op once per chunk; what Overlapped costs above the
floor is the schedule's own. The same timing runs the model with each block's MoE layer taken out
(an identity), unchunked and on the chunks' rows (``dense_compute_ms``, ``dense_chunks_compute_ms``), and
cuts the overhead into three parts in units of the unchunked step: ``overhead_dense`` (the model's
dense layers chunked: no MoE layer and no schedule removes it), ``overhead_moe`` (the rest of the
floor: the MoE layers run once per chunk) and ``overhead_schedule`` (Overlapped over the floor).
Where bench.overlap.yardstick's lean eager layer computes what ours does (one local expert, softmax), the
same timing also runs the model with it in every block, unchunked and its chunks one after another
as one batch (``lean_compute_ms``, ``lean_chunks_compute_ms``): ``lean_overhead`` is our unchunked
step plus the lean layer's increment, over our unchunked step (what the cheapest eager layer we could
write would leave of the overhead), and ``overhead_over_lean`` is Overlapped's overhead minus that.
Pass-aware fields: ``pass_bound_speedup`` (the speedup of a schedule at the pass-aware bound, at this
overhead), ``pass_bound_speedup_no_overhead`` and ``overhead_for_target`` (see :func:`_ceiling_fields`).
``sequential_excess`` is the sequential step over its compute plus its
communication, minus 1: about 0 on a quiet host at the benchmark's sizes. Above 0.01 (printed as a
warning) the step that sleeps through each transfer came back slower than its link (a busy host, or a
tiny step against how late a sleep returns), so the speedups read high.

``--check`` exits with status 1 unless the CPU acceptance holds: hidden_comm_fraction >= 0.6 and
Overlapped faster than both sequential and MoE-internal chunking.

``--microbatches M`` (M > 1) also times a training step of M microbatches: ``Overlapped.accumulate``
(the backward of microbatch i interleaved with the forward of microbatch i+1; with and without
deferred dW) and the Megatron-style pairing (the same turns on unchunked microbatches). The row
gains ``hidden_comm_fraction_accum`` (1 - exposed / the step's M x communication, the exposed time
being the median over the timed rounds of a round's step on the link minus its step on the free
link, run next to it; ``hidden_comm_fraction_accum_fastest`` is the single-step table's
estimate, from the fastest steps, which on a shared machine may come from different moments), its speedup
against M Overlapped steps one after
the other timed with it (``accumulate_sequential``), against M steps of the other schedules above
scaled by their single-step ratio to Overlapped (``speedup_accum_vs_moe_pipelined``: against the
Tutel-style baseline, whose backward is pipelined too), and ``max_hidden_comm_fraction_accum``, the
cross-microbatch analogue of the
pass-aware bound. With ``--check`` the step must hide >= 0.75 and no less than M Overlapped steps
timed with it (the issue's target, >= 0.9 and above the single-step bound, is printed, met or not).
``--dp-allreduce`` times that step with a data-parallel all-reduce of every gradient on the same
link (``lancet_rt.parallel.GradientSync``): whole buckets in FIFO order (``lina_fifo_ms``) vs Lina's
low-priority pieces (``lina_priority_ms``), and the time the all-to-alls waited behind them.

The package: the run on the emulated link (run) or a real one (real, real_runner); its parts: the
command line (args), the shapes (shapes), the timed steps (runner), the cross-microbatch and all-reduce
parts (accumulation), skewed routing (routing), the seed systems (seeds), the timeline drawing (timeline)
and the lean yardstick (yardstick, ``python -m bench.overlap.yardstick``).
"""
