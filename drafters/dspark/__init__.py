"""DSpark: the DFlash block backbone with a predicting anchor slot, a Markov head and a confidence head."""
