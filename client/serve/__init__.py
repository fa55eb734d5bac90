"""``tandem serve``: options, tritonserver's launch and supervision, the repository it serves."""
