"""`specquant diagnose`, the latency doctor: where a workload's time goes (TTFT or ITL, compute or memory), how much
KV cache it needs, and which knob helps, by rerunning the workload with each knob (measured, never guessed).

One job per file: workload (input statistics), split (TTFT vs ITL share), roofline (FLOPs and bytes per token
against the machine's measured peaks), kv_pressure (KV bytes and sequences that fit), whatifs (the options and
their measured runs), recommend (the one option to apply and its command), render (terminal tables and the PNG).
"""
