"""Fitting: the memory answer. What each device has (`device_memory`,
`device_profiles`), what a layout needs of it in closed form (`step_memory`,
its factors in `memory_factors`; `memory`) or compiled for this machine or a
named target (`compiled_step`, `compile_targets`), the choices that depend on
it (`policy`: the mesh, the strategy and the key/value layout under
`"auto"`), and `plan()` itself (`planner`), which asks planning for the
layouts and returns the chosen one as a `LayoutPlan` with its verdict and
advice (`report`, `plot`)."""
