"""The MLX runtime: drafters (`eagle3.Eagle3Drafter`) built from the MLX building blocks in
`layers`, and their parity with the torch reference (`parity`)."""
