"""Benchmarks (`clusterkv bench ...`): speed as ratios measured in one process, printed and written, never asserted.

- `measure`: timing helpers, AOT compilation timed apart, this device's memory bandwidth.
- `roofline`: the bytes one decode step must read (weights, attended KV, the policy's index).
- `synthetic`: random KV with cluster structure for geometries no small real model reaches.
- `decode`: `clusterkv bench decode`, whole-model decode of every policy, interleaved step by step.
- `prefill`: `clusterkv bench prefill`, time to first token of every policy against full KV and HF's prefill.
- `attention`: `clusterkv bench attention`, one layer's decode attention alone.
- `offload`: `clusterkv bench offload`, recall-cache hit rates and host/device bytes.
- `hf`: HF transformers' decode and prefill of the same weights.
- `report`: tables, plots and files.
"""
