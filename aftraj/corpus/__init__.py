"""The corpus builder (DESIGN §4): task pools, multi-agent templates, policy backends, safe
curation, error injection with replay, diagnosis, family splits, export.

    aftraj corpus build --config configs/corpus/demo-small.yaml --out out/demo

Modules: config (typed YAML), tasks (pools, checkers, public-pool readers), sandbox (unit-test
subprocesses), templates (the three agent teams), rollout (engine and replay), policies
(scripted, openai), curate, inject, diagnose, splits, export, build (the pipeline and stats),
verify (replay check of a built corpus's labels: `aftraj corpus verify`).
"""
