"""`minifloat memory`: the training-memory planner (`memory`)."""
