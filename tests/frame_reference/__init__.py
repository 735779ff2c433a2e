"""The detectors and records written row by row and series by series (a Python median per
window): the oracle of tests/test_frame_columns.py, which checks that the column-wise detectors
give the same alerts and records."""
