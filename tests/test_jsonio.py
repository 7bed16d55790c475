import json
import math

from minifloat import jsonio


def test_nonfinite_floats_become_strings_float_reads_back():
    obj = {"a": [1.0, float("inf"), (float("-inf"), {"b": float("nan")})], "n": 3, "s": "nan"}
    text = jsonio.dumps(obj)
    back = json.loads(text, parse_constant=lambda t: (_ for _ in ()).throw(ValueError(t)))  # strict
    assert back["a"][0] == 1.0 and back["n"] == 3
    assert float(back["a"][1]) == math.inf and float(back["a"][2][0]) == -math.inf
    assert math.isnan(float(back["a"][2][1]["b"]))
