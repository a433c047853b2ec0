"""What the bench scripts share, one copy each:

    paths        the repository, bench/results/<script>/ (each script's default output folder)
    provenance   the one machine record every result carries (commit, CPU model and flags, torch, load average)
    flops        the model's shape and its analytic FLOP counts (matmul, forward, backward, generation)
    recorders    what a measurement records while it runs: RSS, timed wrappers, forward and fast-engine hooks
    matmul_peak  the measured GEMM peak a part's FLOPs are set against
    curves       eval curves read from a run's metrics.jsonl; the first eval point at a target accuracy
    steps        the trainer's step functions driven one at a time (a RunState holding what they read)
    report       number formats, markdown and text tables, JSON result files
    value_errors the value-MSE bookkeeping of bench/value_mse.py and bench/value_mse_trajectories.py
"""
