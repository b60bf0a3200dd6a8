"""x86 schedule rules (AVX-512 / AVX2 through the target's vector width), first match wins."""
from mhagen.schedules.x86.attention import AttentionRule
from mhagen.schedules.x86.elementwise import ElementwiseRule, Fallback
from mhagen.schedules.x86.matmul import MatmulRule
from mhagen.schedules.x86.softmax import SoftmaxRule

RULES = [AttentionRule(), MatmulRule(), SoftmaxRule(), ElementwiseRule(), Fallback()]
