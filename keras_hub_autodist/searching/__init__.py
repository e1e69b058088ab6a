"""Searching: the layout search, a stage after the memory answer. For a
named accelerator it lists the candidate layouts (`candidates`, its
arguments checked by `inputs`), prunes them by the closed form, ranks the
rest by the modelled step time (`step_cost`) of the step fitting/ compiles
for them (kept on disk by `cache`), and answers with the fastest that fits
(`search`) and why each lost (`report`). `device_mesh="auto"` on such an
accelerator loads the winner (`auto_mesh`). The package is named for the
stage, like the others: `keras_hub_autodist.search` is the function."""
