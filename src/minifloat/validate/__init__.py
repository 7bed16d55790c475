"""`minifloat validate`: the runner (`runner`) and the examples it checks, times and profiles
(`examples`)."""
