"""Planning: a config and a mesh in, a frozen `LayoutPlan` out. Options are
declared and validated (`options`), the mesh resolved once (`mesh`), the
weights' shapes found by an abstract build (`abstract`, `shapes`), laid out
by each family's rules (`sharding`, `policy`), and costed (`memory`,
`step_memory`, `compiled_step`). Nothing here loads a weight."""
