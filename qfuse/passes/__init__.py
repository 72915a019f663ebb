"""qfuse's FX graph passes. The pass manager (`manager.QfusePass`) runs them in order."""
