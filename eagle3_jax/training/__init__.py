"""Training the draft head: the training-time-test (TTT) loss (`ttt`)."""
