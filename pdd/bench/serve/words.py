"""The vocabulary synthetic prompts are written with (no dataset can be downloaded here).

Plain lower-case English words, so every word is one pre-tokenizer piece (" word") and token
counts add up word by word. ``TOOLS`` names the fake tools agentic turns call.
"""

from __future__ import annotations

WORDS: tuple[str, ...] = tuple(
    """
    able about above accept account across act action active actual add address admit adult
    affect after again against age agency agent agree ahead air all allow almost alone along
    already also although always among amount analysis animal another answer any anyone
    anything appear apply approach area argue arm around arrive art article artist ask assume
    attack attention audience author available avoid away baby back bad bag ball bank bar base
    beat beautiful because become bed before begin behavior behind believe benefit best better
    between beyond big bill billion bit black blood blue board body book born both box boy
    break bring brother budget build building business buy call camera campaign cancer
    candidate capital car card care career carry case catch cause cell center central century
    certain chair challenge chance change character charge check child choice choose church
    citizen city civil claim class clear clearly close coach cold collection college color
    come commercial common community company compare computer concern condition conference
    consider consumer contain continue control cost could country couple course court cover
    create crime cultural culture cup current customer cut dark data daughter day dead deal
    death debate decade decide decision deep defense degree describe design despite detail
    determine develop difference different difficult dinner direction director discover
    discuss disease doctor dog door down draw dream drive drop drug during each early east easy
    eat economic economy edge education effect effort eight either election else employee end
    energy enjoy enough enter entire environment especially establish even evening event ever
    every everybody everyone everything evidence exactly example executive exist expect
    experience expert explain eye face fact factor fail fall family far fast father fear
    federal feel feeling few field fight figure fill film final finally financial find fine
    finger finish fire firm first fish five floor fly focus follow food foot force foreign
    forget form former forward four free friend from front full fund future game garden gas
    general generation get girl give glass goal good government great green ground group grow
    growth guess gun guy hair half hand hang happen happy hard have head health hear heart heat
    heavy help here herself high himself history hit hold home hope hospital hot hotel hour
    house however huge human hundred husband idea identify image imagine impact important
    improve include including increase indeed indicate individual industry information inside
    instead institution interest interesting international interview into investment involve
    issue item itself job join just keep key kid kill kind kitchen know knowledge land language
    large last late later laugh law lawyer lay lead leader learn least leave left leg legal
    less letter level lie life light like likely line list listen little live local long look
    lose loss lot love low machine magazine main maintain major majority make man manage
    management manager many market marriage material matter maybe mean measure media medical
    meet meeting member memory mention message method middle might military million mind
    minute miss mission model modern moment money month more morning most mother mouth move
    movement movie much music must myself name nation national natural nature near nearly
    necessary need network never news newspaper next nice night none nor north note nothing
    notice now number occur off offer office officer official often oil old once one only onto
    open operation opportunity option order organization other others our out outside over
    own owner page pain painting paper parent part participant particular particularly partner
    party pass past patient pattern pay peace people per perform performance perhaps period
    person personal phone physical pick picture piece place plan plant play player point
    police policy political politics poor popular population position positive possible power
    practice prepare present president pressure pretty prevent price private probably problem
    process produce product production professional professor program project property
    protect prove provide public pull purpose push put quality question quickly quite race
    radio raise range rate rather reach read ready real reality realize really reason receive
    recent recently recognize record red reduce reflect region relate relationship religious
    remain remember remove report represent require research resource respond response rest
    result return reveal rich right rise risk road rock role room rule run safe same save
    scene school science scientist score sea season seat second section security see seek seem
    sell send senior sense series serious serve service set seven several shake share shoot
    short shot should shoulder show side sign significant similar simple simply since sing
    single sister sit site situation six size skill skin small smile social society soldier
    some somebody someone something sometimes son song soon sort sound source south southern
    space speak special specific speech spend sport spring staff stage stand standard star
    start state statement station stay step still stock stop store story strategy street
    strong structure student study stuff style subject success successful such suddenly
    suffer suggest summer support sure surface system table take talk task tax teach teacher
    team technology television tell ten tend term test than thank that their them themselves
    then theory there these they thing think third this those though thought thousand threat
    three through throughout throw thus time today together tonight too top total tough toward
    town trade traditional training travel treat treatment tree trial trip trouble true truth
    try turn two type under understand unit until upon use usually value various very victim
    view violence visit voice vote wait walk wall want war watch water way weapon wear week
    weight well west western what whatever when where whether which while white whole whom
    whose why wide wife will win wind window wish with within without woman wonder word work
    worker world worry would write writer wrong yard yeah year yes yet young yourself
    """.split()
)

TOOLS: tuple[str, ...] = (
    "search",
    "read_file",
    "write_file",
    "run_shell",
    "list_dir",
    "fetch_url",
    "query_db",
    "grep",
)
