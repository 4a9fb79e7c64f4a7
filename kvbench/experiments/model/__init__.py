"""verify, bench and memory of a whole decoder (`run`) and their tables (`view`)."""
