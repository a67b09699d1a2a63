"""Everything behind `moestreamctl bench`: drivers, their shared timing, policy replay, the soak."""
