"""Benchmarks (`clusterkv bench ...`): speed as ratios measured in one process, printed and written, never asserted.

- `measure`: timing helpers, AOT compilation timed apart, this device's memory bandwidth.
- `roofline`: the bytes one decode step must read (weights, attended KV, the policy's index).
- `synthetic`: random KV with cluster structure for geometries no small real model reaches.
- `decode`: `clusterkv bench decode`, whole-model decode of every policy, interleaved step by step.
- `attention`: `clusterkv bench attention`, one layer's decode attention alone.
- `offload`: `clusterkv bench offload`, recall-cache hit rates and host/device bytes.
- `hf`: HF transformers' decode of the same weights (`--compare-hf`).
- `report`: tables, plots and files.
"""
