"""The measurements behind the commands that compare formats, each module named for its command:
`compare` (train in several precisions), `ptq_compare`, `adapt` (with `strategies`), `bench`
(`bench_decode` for ``bench decode``), `error_analysis` (``minifloat error``) and `devices`
(``minifloat info``)."""
