"""Evaluation: RULER, LongBench, GSM8K and fidelity sweeps over KV-cache methods, budgets and lengths.

Modules: ``metrics`` (official scoring functions), ``ruler`` / ``longbench`` / ``gsm8k`` / ``fidelity`` (data
and prompts), ``sweep`` (the resumable runner, summary tables), ``harness`` (model glue), ``plots`` (Pareto
plots) and ``cli`` (``qevict eval ...``).
"""
