"""Grammar-constrained output: a :class:`~clover_lab.grammar.grammar.Grammar` compiled once per
request (a JSON schema, any JSON object, or the tool-call format), a
:class:`~clover_lab.grammar.constraint.Constraint` per row that says which tokens may come next
(``masks``) and follows the row's committed tokens (``accept``), and
:class:`~clover_lab.grammar.policy.GrammarPolicy`, the decoding rule that keeps block diffusion
inside the grammar although it unmasks positions out of order.

The grammar engine is llguidance (``vocabulary.py`` says why); its errors are
:class:`clover_lab.errors.GrammarError`.
"""
from clover_lab.grammar.constraint import Constraint
from clover_lab.grammar.grammar import Grammar
from clover_lab.grammar.policy import GrammarPolicy

__all__ = ["Constraint", "Grammar", "GrammarPolicy"]
