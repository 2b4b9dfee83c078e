"""Phantom text: a radiology-style report, RDF-style triples and CheXpert-14 labels for a case.

The report has a findings section (devices, heart, lungs, pleura, bones; several templates per
finding, with side, zone and severity words) and an impression. Absent key findings are
negated explicitly ("No pneumothorax.", "Heart size is normal."), and the labels follow the
text: 1 for a described finding, 0 for a finding a sentence negates, None when not mentioned.
"No Finding" is 1 exactly when there is no pathology (support devices alone are normal).

Triple vocabulary (shared with the captions and the real-data sources):
    (finding, HAS_LOCATION, anatomy)   anatomy e.g. right_hemithorax, left_upper_zone,
                                       right_lung_base, bilateral_perihilar, cardiac_silhouette
    (finding, HAS_SEVERITY, modifier)  see cases.SEVERITIES
    (finding, IS_A, category)          cardiac_abnormality, pleural_abnormality, lung_lesion,
                                       parenchymal_opacity, device
    (finding, ASSOCIATED_WITH, finding) effusion-atelectasis, edema-cardiomegaly,
                                       consolidation-effusion
"""
from __future__ import annotations

import numpy as np

from cxrdr.common.augment import stable_seed
from cxrdr.reinforce.phantom.cases import DEVICE, Case, Finding
from cxrdr.common.labels import CHEXPERT14

CATEGORY = {"cardiomegaly": "cardiac_abnormality", "pleural_effusion": "pleural_abnormality",
            "pneumothorax": "pleural_abnormality", "nodule": "lung_lesion", "mass": "lung_lesion",
            "consolidation": "parenchymal_opacity", "lung_opacity": "parenchymal_opacity",
            "atelectasis": "parenchymal_opacity", "edema": "parenchymal_opacity", DEVICE: "device"}
CHEXPERT_LABEL = {"cardiomegaly": "Cardiomegaly", "pleural_effusion": "Pleural Effusion",
                  "pneumothorax": "Pneumothorax", "nodule": "Lung Lesion", "mass": "Lung Lesion",
                  "consolidation": "Consolidation", "lung_opacity": "Lung Opacity",
                  "atelectasis": "Atelectasis", "edema": "Edema", DEVICE: "Support Devices"}
DEVICE_LOCATION = {"endotracheal_tube": "trachea", "central_venous_catheter": "superior_vena_cava",
                   "nasogastric_tube": "stomach", "ecg_leads": "chest_wall"}
# Pairs (a, b) that yield (a, ASSOCIATED_WITH, b) when both are present.
ASSOCIATIONS = (("pleural_effusion", "atelectasis"), ("edema", "cardiomegaly"),
                ("consolidation", "pleural_effusion"))
LUNG_KINDS = {"nodule", "mass", "consolidation", "lung_opacity", "atelectasis", "edema"}

ADVERB = {"mild": "mildly", "moderate": "moderately", "severe": "markedly"}
ZONE_WORDS = {"upper": ("upper zone", "upper lung zone", "upper lung"),
              "mid": ("mid zone", "mid lung zone", "mid lung"),
              "lower": ("lower zone", "lower lung zone", "lower lung")}

FINDING_TEMPLATES: dict[str, tuple[str, ...]] = {
    "cardiomegaly": ("The heart is {adv} enlarged.", "{sev} cardiomegaly.",
                     "The cardiac silhouette is {adv} enlarged, cardiothoracic ratio about {ctr}.",
                     "There is {sev} enlargement of the cardiac silhouette."),
    "pleural_effusion": ("There is a {sev} {side} pleural effusion.",
                         "{sev} {side} pleural effusion blunting the {side} costophrenic angle.",
                         "A {sev} {side} pleural effusion is present with a meniscus at the {side} base.",
                         "The {side} costophrenic angle is blunted by a {sev} pleural effusion."),
    "pleural_effusion/bilateral": ("There are {sev} bilateral pleural effusions.",
                                   "{sev} bilateral pleural effusions blunting both costophrenic angles.",
                                   "Both costophrenic angles are blunted by {sev} pleural effusions."),
    "pneumothorax": ("There is a {sev} {side} apical pneumothorax.",
                     "{sev} {side} pneumothorax with a visible visceral pleural line.",
                     "A {side} pneumothorax is present, {sev} in size.",
                     "{side} pneumothorax, {sev}, with absent lung markings at the apex."),
    "nodule": ("A {sev} {mm} mm nodule is seen in the {loc}.",
               "There is a {sev} nodular opacity in the {loc}.",
               "{loc} nodule measuring approximately {mm} mm, {sev} in size."),
    "mass": ("There is a {sev} mass in the {loc}, measuring about {cm} cm.",
             "A {cm} cm {sev} mass is identified in the {loc}.",
             "{sev} rounded mass projecting over the {loc}."),
    "consolidation": ("{sev} consolidation in the {loc}.",
                      "There is {sev} airspace consolidation in the {loc}.",
                      "Patchy {sev} consolidation is seen in the {loc}."),
    "lung_opacity": ("Ill-defined {sev} opacity in the {loc}.",
                     "There is a {sev} hazy opacity in the {loc}.",
                     "{sev} patchy opacity projects over the {loc}."),
    "atelectasis": ("{sev} linear atelectasis at the {side} lung base.",
                    "Plate-like atelectasis at the {side} base, {sev}.",
                    "Band-like opacity at the {side} base consistent with {sev} atelectasis."),
    "atelectasis/bilateral": ("{sev} bibasilar linear atelectasis.",
                              "Band-like opacities at both lung bases consistent with {sev} atelectasis."),
    "edema": ("{sev} pulmonary edema with perihilar haziness.",
              "There is {sev} interstitial edema with bilateral perihilar opacities.",
              "Bilateral perihilar hazy opacities consistent with {sev} pulmonary edema."),
}
IMPRESSION_TEMPLATES: dict[str, tuple[str, ...]] = {
    "cardiomegaly": ("{sev} cardiomegaly.",),
    "pleural_effusion": ("{sev} {side} pleural effusion.",),
    "pleural_effusion/bilateral": ("{sev} bilateral pleural effusions.",),
    "pneumothorax": ("{sev} {side} pneumothorax.", "{side} pneumothorax, {sev}."),
    "nodule": ("{sev} {loc} nodule.", "{sev} {loc} pulmonary nodule; CT follow-up suggested."),
    "mass": ("{loc} mass, {sev}; further evaluation with CT recommended.", "{sev} {loc} mass."),
    "consolidation": ("{sev} consolidation in the {loc}.",),
    "lung_opacity": ("{sev} opacity in the {loc}.",),
    "atelectasis": ("{sev} {side} basilar atelectasis.",),
    "atelectasis/bilateral": ("{sev} bibasilar atelectasis.",),
    "edema": ("{sev} pulmonary edema.",),
}
DEVICE_TEMPLATES = {
    "endotracheal_tube": ("An endotracheal tube terminates above the carina.",
                          "Endotracheal tube in place, tip about {cm} cm above the carina."),
    "central_venous_catheter": ("{side} internal jugular central venous catheter with tip in the SVC.",
                                "A {side}-sided central line terminates in the superior vena cava."),
    "nasogastric_tube": ("An enteric tube courses below the diaphragm into the stomach.",
                         "Nasogastric tube tip in the stomach."),
    "ecg_leads": ("ECG leads overlie the chest.", "Cardiac monitoring leads are noted."),
}
NORMAL_IMPRESSIONS = ("No acute cardiopulmonary process.", "No acute cardiopulmonary abnormality.",
                      "No acute intrathoracic abnormality.")
# Negation sentences and the labels each sets to 0.
NEG_HEART = (("Heart size is normal.", ("Cardiomegaly",)),
             ("The cardiac silhouette is within normal limits.", ("Cardiomegaly",)),
             ("Normal heart size.", ("Cardiomegaly",)),
             ("The cardiomediastinal silhouette is normal.", ("Cardiomegaly", "Enlarged Cardiomediastinum")))
NEG_EFFUSION = ("No pleural effusion.", "There is no pleural effusion.", "No evidence of pleural effusion.")
NEG_PNEUMOTHORAX = ("No pneumothorax.", "There is no pneumothorax.", "No evidence of pneumothorax.")
NEG_BOTH = ("No pleural effusion or pneumothorax.", "There is no pleural effusion or pneumothorax.")
NEG_CLEAR = ("The lungs are clear.", "Lungs are clear bilaterally.")
NEG_CONSOLIDATION = ("No focal consolidation.", "There is no focal consolidation.")
NEG_EDEMA = ("No pulmonary edema.", "No evidence of pulmonary edema.")
NEG_BONES = ("No acute osseous abnormality.", "No displaced rib fracture.")


def anatomy(f: Finding) -> str:
    """The HAS_LOCATION object of a finding."""
    if f.kind == "cardiomegaly":
        return "cardiac_silhouette"
    if f.kind == DEVICE:
        return DEVICE_LOCATION[f.device]
    if f.kind == "edema":
        return "bilateral_perihilar"
    bilateral = f.side == "bilateral"
    if f.kind == "pleural_effusion":
        return "bilateral_hemithoraces" if bilateral else f"{f.side}_hemithorax"
    if f.kind == "pneumothorax":
        return f"{f.side}_lung_apex" if f.severity == "small" else f"{f.side}_hemithorax"
    if f.kind == "atelectasis":
        return "bilateral_lung_bases" if bilateral else f"{f.side}_lung_base"
    return f"bilateral_{f.zone}_zones" if bilateral else f"{f.side}_{f.zone}_zone"


def make_triples(case: Case) -> list[tuple[str, str, str]]:
    triples: list[tuple[str, str, str]] = []
    for f in case.findings:
        for triple in ((f.kind, "HAS_LOCATION", anatomy(f)),
                       (f.kind, "HAS_SEVERITY", f.severity) if f.severity else None,
                       (f.kind, "IS_A", CATEGORY[f.kind])):
            if triple and triple not in triples:
                triples.append(triple)
    for a, b in ASSOCIATIONS:
        if case.has(a) and case.has(b):
            triples.append((a, "ASSOCIATED_WITH", b))
    return triples


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _fill(template: str, f: Finding, case: Case, rng) -> str:
    side = f.side
    loc = ""
    if f.zone in ZONE_WORDS:
        words = ZONE_WORDS[f.zone]
        zone = words[int(rng.integers(len(words)))]
        loc = f"bilateral {zone}s" if side == "bilateral" else f"{side} {zone}"
    mm = f.params.get("diameter_mm", 0.0)
    return _cap(template.format(sev=f.severity, adv=ADVERB.get(f.severity, f.severity), side=side, loc=loc,
                                mm=int(round(mm)), cm=f"{mm / 10:.1f}" if mm else f"{3 + rng.integers(0, 3)}",
                                ctr=f"{case.geometry.ctr:.2f}"))


def _choose(options, rng):
    return options[int(rng.integers(len(options)))]


def _key(f: Finding) -> str:
    return f"{f.kind}/bilateral" if f.side == "bilateral" and f"{f.kind}/bilateral" in FINDING_TEMPLATES else f.kind


ORDER = ("cardiomegaly", "edema", "consolidation", "lung_opacity", "mass", "nodule", "atelectasis",
         "pleural_effusion", "pneumothorax")


def make_report(case: Case) -> tuple[str, str, dict[str, int | None]]:
    """(findings text, impression text, CheXpert-14 labels) for a case."""
    rng = np.random.default_rng(stable_seed("phantom-report", case.seed, case.index))
    labels: dict[str, int | None] = {name: None for name in CHEXPERT14}
    negated: set[str] = set()
    sentences: list[str] = []
    if case.view == "AP" and rng.random() < 0.5:
        sentences.append(_choose(("Single portable AP view of the chest.", "Portable AP chest radiograph."), rng))
    for f in case.devices:
        sentences.append(_fill(_choose(DEVICE_TEMPLATES[f.device], rng), f, case, rng))
    path = sorted(case.pathologies, key=lambda f: ORDER.index(f.kind))
    kinds = {f.kind for f in path}

    def negate(options, rng_local=rng):
        text, names = options[int(rng_local.integers(len(options)))]
        sentences.append(text)
        negated.update(names)

    if "cardiomegaly" not in kinds:
        negate(NEG_HEART)
    for f in path:
        if f.kind not in ("pleural_effusion", "pneumothorax"):
            sentences.append(_fill(_choose(FINDING_TEMPLATES[_key(f)], rng), f, case, rng))
    if not kinds & LUNG_KINDS and rng.random() < 0.8:
        negate([(t, ("Lung Opacity",)) for t in NEG_CLEAR])
    if not kinds & {"consolidation", "lung_opacity"} and rng.random() < 0.6:
        negate([(t, ("Consolidation",)) for t in NEG_CONSOLIDATION])
    if "edema" not in kinds and rng.random() < 0.5:
        negate([(t, ("Edema",)) for t in NEG_EDEMA])
    for f in path:
        if f.kind in ("pleural_effusion", "pneumothorax"):
            sentences.append(_fill(_choose(FINDING_TEMPLATES[_key(f)], rng), f, case, rng))
    no_eff, no_ptx = "pleural_effusion" not in kinds, "pneumothorax" not in kinds
    if no_eff and no_ptx and rng.random() < 0.5:
        negate([(t, ("Pleural Effusion", "Pneumothorax")) for t in NEG_BOTH])
    else:
        if no_eff:
            negate([(t, ("Pleural Effusion",)) for t in NEG_EFFUSION])
        if no_ptx:
            negate([(t, ("Pneumothorax",)) for t in NEG_PNEUMOTHORAX])
    if rng.random() < 0.35:
        negate([(t, ("Fracture",)) for t in NEG_BONES])

    impression: list[str] = []
    for f in path:
        if f.kind == "atelectasis" and "pleural_effusion" in kinds:
            continue  # folded into the effusion's impression below
        text = _fill(_choose(IMPRESSION_TEMPLATES[_key(f)], rng), f, case, rng)
        if f.kind == "pleural_effusion" and "atelectasis" in kinds:
            text = text[:-1] + " with adjacent atelectasis."
        if f.kind == "cardiomegaly" and "edema" in kinds:
            text = text[:-1] + " with pulmonary edema."
        if f.kind == "edema" and "cardiomegaly" in kinds:
            continue
        impression.append(text)
    if not impression:
        impression.append(_choose(NORMAL_IMPRESSIONS, rng))

    for name in negated:
        labels[name] = 0
    for f in case.findings:
        labels[CHEXPERT_LABEL[f.kind]] = 1
    labels["No Finding"] = 0 if path else 1
    return " ".join(sentences), " ".join(impression), labels
