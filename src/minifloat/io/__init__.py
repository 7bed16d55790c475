"""Files that survive a crash and parse anywhere: atomic writes, strict JSON."""
