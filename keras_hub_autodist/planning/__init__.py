"""Planning: a config and a mesh in, the ways to lay its weights out. Options
are declared and validated (`options`), the mesh's axes read (`mesh`), the
weights' shapes found by an abstract build (`abstract`, `shapes`), laid out
by each family's rules (`sharding`), and each alternative layout's
per-device parameter bytes counted (`layouts`). Nothing here loads a weight
or answers what fits in memory: that is the fitting stage's."""
