"""The paper's diagnostics (Future Missed Mass, selection churn, Global LIR, QSA, RQ, lag-δ transition matrices,
tier-mass distribution) on teacher-forced traces: ``trace`` (the Full-KV reference and the policy traces),
``metrics`` (pure numpy functions of them), ``report`` (per-passage metrics, aggregation, tables and JSON records)
and ``run`` (``qevict diagnose``)."""
