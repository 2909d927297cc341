"""Decision training on every prefix (NOT in the paper; docs/design.md §8, issue 21): the
decision token of the canonical completion, SAFE before k* and ALARM at k*, trained by
cross-entropy on every prefix of every run at once (a run's prefixes packed,
`aftraj.scoring.Pack`), the top N decoder layers from frozen-layer features. The pairs of stage 1
train two positions of a run; the strict online walk needs the decision at every one.

    aftraj train prefixes --config configs/prefixes/smollm2-135m-cpu.yaml --data CORPUS --model STAGE1 --out RUN
"""
