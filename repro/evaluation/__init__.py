"""Zero-shot evaluation through lm-eval, offline (the modules: docs/development.md, "Layout"). Importing this
package does not import lm-eval.
"""
