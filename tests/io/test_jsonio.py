import json
import math

from minifloat.io import jsonio


def test_nonfinite_floats_become_strings_float_reads_back():
    obj = {"a": [1.0, float("inf"), (float("-inf"), {"b": float("nan")})], "n": 3, "s": "nan"}
    text = jsonio.dumps(obj)
    back = json.loads(text, parse_constant=lambda t: (_ for _ in ()).throw(ValueError(t)))  # strict
    assert back["a"][0] == 1.0 and back["n"] == 3
    assert float(back["a"][1]) == math.inf and float(back["a"][2][0]) == -math.inf
    assert math.isnan(float(back["a"][2][1]["b"]))
    # loads reads it back as floats (a string "nan" too: the log and metrics files hold none).
    again = jsonio.loads(text)
    assert again["a"][:1] == [1.0] and again["a"][1] == math.inf and again["a"][2][0] == -math.inf
    assert math.isnan(again["a"][2][1]["b"]) and math.isnan(again["s"]) and again["n"] == 3
    assert math.isnan(jsonio.loads('{"x": NaN}')["x"])  # logs written before the strings
