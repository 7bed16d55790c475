"""The examples `minifloat validate` runs, one module each (`minifloat.validate.runner`)."""
