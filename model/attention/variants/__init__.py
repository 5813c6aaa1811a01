"""Each attention variant's math, a module per idea, on the dense core's
signature (model/attention/__init__.py registers them by name). Imports
core/ and kernels/ (a variant runs on the fused kernel the table chooses
where one computes its case)."""
