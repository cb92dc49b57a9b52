"""Ablation grids: many heads trained from ONE set of precomputed target features, each evaluated on
the same questions, summarised in one table.

An `AblationConfig` (a Python config file, see configs/ablate_*.py) holds a base `TrainConfig` and
named cells, each a dict of TrainConfig overrides (aux_layer_ids, ttt_steps, feature_loss_weight,
draft_vocab_size, ...). `run_ablation`:
  1. builds the dataset once (OUT/shared) and precomputes the target's features once (OUT/features)
     for the union of every cell's aux layers (plus the final hidden state);
  2. trains each cell in OUT/cells/NAME with the same data, seed and step budget (and data order,
     for cells of one batch size)
     (offline features; resumes a cell interrupted mid-run, skips a finished one);
  3. evaluates each head with the harness (tau only, no vanilla) on the same questions and tree;
  4. writes OUT/results.json, OUT/report.md, OUT/tau_per_cell.png and OUT/acc_by_ttt_step.png,
     again as each cell finishes (a partial report names the cells still to come).
Every stage is resumable: rerunning the same command continues where it stopped.

The grid's configuration and cells are `config`'s, the run `runner`'s, results.json, report.md
and the plots `report`'s.
"""
