"""Benchmarks of keras-hub-autodist against keras-hub's static layout maps.

`python -m bench` regenerates docs/benchmarks.md and its plots; see
`bench/__main__.py`. Not run by CI (absolute timings on shared CPUs are noise;
every claim is a ratio measured side by side in one run).
"""
